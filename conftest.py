"""Repository-level pytest configuration. The harness's own plugin (options --target/--tp/--profile,
markers, session pools) loads through its `pytest11` entry point once the package is installed;
loading it here too keeps a plain checkout working without the install."""
import importlib.metadata

if not any(ep.value == "harness.plugin" for ep in importlib.metadata.entry_points(group="pytest11")):
    pytest_plugins = ["harness.plugin"]
