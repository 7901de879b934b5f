"""The ``packrat-mq`` command line: one click group, a module per command."""
from __future__ import annotations

import errno
import importlib
import os
from typing import Any

import click

from packrat_mq import __version__
from packrat_mq.cli.helpers import URL_KEY, describe_failure, err, is_connection_failure
from packrat_mq.interrupts import exit_code, terminate_as_interrupt


class PackratGroup(click.Group):
    """The command group: whatever goes wrong ends in one line on stderr, not a traceback.

    Connection, authentication and TLS failures, unusable URLs and a missing
    embedded server all end as a ``ClickException`` (exit code 1) that names
    the URL with its password redacted. A usage error is one line too (exit
    code 2). SIGTERM and SIGHUP stop a command as Ctrl-C does: its ``finally``
    blocks run, so what it started is stopped; it then exits with 128 + the
    signal's number.
    """

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _one_line(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        args = list(ctx.args)  # the command's own arguments; invoke() empties ctx.args
        try:
            with terminate_as_interrupt():
                return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            err(f"interrupted by {exc.args[0] if exc.args else 'SIGINT'}")
            ctx.exit(exit_code(exc))
        except click.UsageError as exc:
            raise _one_line(exc) from None
        except Exception as exc:
            if not is_connection_failure(exc) or getattr(exc, "errno", None) == errno.EPIPE:
                raise
            url = ctx.meta.get(URL_KEY) or _url_in_args(args)
            raise click.ClickException(describe_failure(exc, url)) from None


class OneLineUsageError(click.UsageError):
    """A usage error as one line, ``Error: <what> (try 'packrat-mq up --help')``, instead of click's three."""

    def show(self, file: Any = None) -> None:
        hint = f" (try '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        click.echo(f"Error: {self.format_message()}{hint}", file=file, err=file is None)


def _one_line(exc: click.UsageError) -> click.UsageError:
    if isinstance(exc, (OneLineUsageError, click.exceptions.NoArgsIsHelpError)):
        return exc  # already one line; or the help a bare group prints
    return OneLineUsageError(exc.format_message(), exc.ctx)


def _url_in_args(args: list[str]) -> str | None:
    """``--redis-url`` as given to a command that did not record it (``optimize --calibrate``)."""
    for i, arg in enumerate(args):
        if arg == "--redis-url" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--redis-url="):
            return arg.partition("=")[2]
    return os.environ.get("PACKRAT_REDIS_URL")


@click.group(cls=PackratGroup, context_settings={"help_option_names": ["-h", "--help"]})
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
    ("packrat_mq.cli.reconfigure", "reconfigure"),
    ("packrat_mq.cli.reconfigure", "models"),
    ("packrat_mq.cli.node_cmd", "node"),
    ("packrat_mq.cli.optimize_cmd", "optimize"),
    ("packrat_mq.cli.profile_cmd", "profile"),
]

for _module, _attr in _COMMANDS:
    main.add_command(getattr(importlib.import_module(_module), _attr))

# `profile run` lives in its own module: it drives the profiler, the rest of `profile` only reads files.
main.commands["profile"].add_command(importlib.import_module("packrat_mq.cli.profile_run").run)  # type: ignore[attr-defined]
# So does `profile path`: it serves for real to measure the serving path.
main.commands["profile"].add_command(importlib.import_module("packrat_mq.cli.profile_path").path)  # type: ignore[attr-defined]
