"""What every layer shares: the harness's own errors (`errors`), the options of the CLI and the
pytest plugin with their defaults and the run's configuration (`options`), and the level registry
(`levels`: each routine family's `Level` object, which the modules of `harness.levels` register and
the registry imports by name when first asked, so no layer below them imports one)."""
