"""Instruments, with no knowledge of cases or targets: the per-rank collective trace, the memory
meter (bytes allocated, saved and freed by one call), and the clocks and statistics of timing."""
