"""What every layer shares, importing nothing of the harness: the harness's own errors (`errors`),
and the options of the CLI and the pytest plugin with their defaults and the run's configuration
(`options`)."""
