"""Subcommands of the `edgeinfer` CLI, one module each (see edgeinfer/cli.py)."""
