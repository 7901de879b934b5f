"""The ``packrat-mq`` command line (placeholder until the commands land)."""
from __future__ import annotations

import click


@click.group()
def main() -> None:
    """packrat-mq: Packrat-style CPU inference serving on Redis streams."""
