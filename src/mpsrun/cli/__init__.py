"""The `mpsrun` command: parses, calls, prints, sets exit codes. Nothing else.

One module per group of commands; each registers on the shared Typer `app`.
"""

from __future__ import annotations

import os

from mpsrun.cli import run, plugins, devices, bench, resume, sync  # noqa: F401,I001  (registers the commands, in --help order)
from mpsrun.cli import eval as _eval  # noqa: F401,E402  (registers `mpsrun eval`)
from mpsrun.cli.common import EXIT_INTERRUPT, app, err

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point; maps a stray Ctrl-C to exit 130."""
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        raise SystemExit(EXIT_INTERRUPT) from None
