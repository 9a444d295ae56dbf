"""The rank side of the engine, what runs in the workers: `rank` is a worker's loop (join the process
group, run each job the driver sends, reply), `calls` builds a rank's shard of a case, `executor`
runs one case on a rank and records an `Observation` (`observations`: all that ranks send back),
`wire` carries a rank's reply to the driver (tensors as their raw bytes), `progress` is the shared
memory where workers publish their collective progress (how stuck ranks are found), `stacks` samples
a rank's stack. The driver side, which sends the jobs, is `harness.driver`."""
