"""The subcommands of `python -m harness`, one module each; each has `register(subparsers)`."""
