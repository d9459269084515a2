"""Subcommands of the ``lightning-pp`` CLI, one module each (see ``lightning_pp.commands.cli``)."""
