"""Instruments, with no knowledge of cases or targets: the per-rank collective trace and the memory
meter (bytes allocated, saved and freed by one call). The clocks of timing are the performance
gate's (`harness.perf.timing`)."""
