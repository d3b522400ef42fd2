"""The `offload-connector` command (a face): `replay` through the fake engine, `check` of a config."""

from offload_connector.cli.main import main

__all__ = ["main"]
