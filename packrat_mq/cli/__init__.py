"""The ``packrat-mq`` command line: one click group, a module per command."""
from __future__ import annotations

import importlib

import click

from packrat_mq import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="packrat-mq")
def main() -> None:
    """packrat-mq: Packrat-style CPU inference serving on Redis streams.

    \b
    Quick start:
      packrat-mq up --model echo --instances 1x4,1x4     # terminal 1
      packrat-mq submit --model echo --data '{"hi": 1}'  # terminal 2
      packrat-mq status
    """


# (module, attribute) of each command.
_COMMANDS = [
    ("packrat_mq.cli.serve", "up"),
    ("packrat_mq.cli.serve", "dispatch"),
    ("packrat_mq.cli.serve", "pool"),
    ("packrat_mq.cli.submit", "submit"),
    ("packrat_mq.cli.status", "status"),
    ("packrat_mq.cli.optimize_cmd", "optimize"),
    ("packrat_mq.cli.profile_cmd", "profile"),
]

for _module, _attr in _COMMANDS:
    main.add_command(getattr(importlib.import_module(_module), _attr))

# `profile run` lives in its own module: it drives the profiler, the rest of `profile` only reads files.
main.commands["profile"].add_command(importlib.import_module("packrat_mq.cli.profile_run").run)  # type: ignore[attr-defined]
