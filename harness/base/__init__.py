"""What every layer above shares: the harness's own errors (`errors`), the options and the run's
configuration (`options`), and what a rank observed while running one case (`observations`)."""
