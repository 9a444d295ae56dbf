"""The driver side of the engine, in the main process: `pool` keeps one persistent group of worker
processes per (TP, CP, DP) size and sends each job to every rank, `process` holds what the driver
process keeps once for all its pools (the live pools, the parking thread, the interrupting signal),
`torchrun` serves the same jobs on launched ranks, `runner` sends a case to its pool and evaluates
the checks on what came back, `explorer` draws cases with Hypothesis and replays the regression
corpus, `limits` keeps a run from paying for a known hang twice and stops it at --max-findings."""
