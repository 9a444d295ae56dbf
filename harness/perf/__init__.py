"""The performance gate: `gate` records and compares baselines (`check --save-baseline`,
`--baseline`), `jobs` are the timing jobs it runs on a case's pool, `timing` their clocks and
statistics, `callgrind` counts the instructions of one rank's call under valgrind.

Ranks import `jobs` by name (`harness.perf.jobs:time_job`): this package imports nothing here."""
