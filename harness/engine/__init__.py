"""What runs cases. The rank side runs in the workers: `calls` builds a rank's shard of a case,
`executor` runs one case on a rank and records an `Observation`, `perf_jobs` times calls, `pool`
keeps one persistent group of worker processes per (TP size, DP size), `wire` carries a rank's
reply to the driver (tensors as their raw bytes), `progress` is the shared memory where workers
publish their collective progress (how stuck ranks are found), `torchrun` serves the same jobs on
launched ranks, `callgrind` runs one rank under valgrind. The driver side runs in the main
process: `runner` sends a case to every rank of its pool and evaluates the checks on what came
back; `explorer` draws cases with Hypothesis and replays the regression corpus; `limits` keeps a
run from paying for a known hang twice and stops it at --max-findings."""
