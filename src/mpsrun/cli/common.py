"""What every command shares: the Typer app, the consoles, exit codes, recipe loading with exit-2 errors.

Exit codes: 0 done, 2 bad input (recipe, override, CLI, unusable device, missing
data, unreachable server), 1 failure while running, 130 interrupted (SIGINT),
143 terminated (SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

import typer
from rich.console import Console

# Set by `mpsrun run` once its run has begun: the console entry point (`main`) then ends the process
# without Python's finalisation once the command is over (cli/__init__.py `_end`).
END_WITHOUT_FINALISATION = False

app = typer.Typer(
    name="mpsrun",
    help="Train what a YAML recipe declares on MPS, CUDA or CPU, with honest timings, tracked in MLflow.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _console(stderr: bool = False) -> Console:
    """A console that reads well where it lands.

    In a terminal: Rich as usual (colour, bars, tables fitted to the window). Outside one
    (CI logs, Slurm, `docker logs`, `| tee`) Rich would assume 80 columns and break every
    longer line, leaving "samples/s" alone on the next one; there a message is one whole
    line (soft wrap: the reader's pager or log viewer wraps it) and tables get room
    (`$COLUMNS` when set, else 200; a table takes only the width it needs).
    """
    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream
        tty = False
    if tty:
        return Console(stderr=stderr)
    columns = os.environ.get("COLUMNS", "")
    return Console(stderr=stderr, soft_wrap=True, width=int(columns) if columns.isdigit() and int(columns) > 0 else 200)


console = _console()
err = _console(stderr=True)

from mpsrun.exitcodes import EXIT_FAIL, EXIT_INPUT, EXIT_INTERRUPT, EXIT_OK, EXIT_TERM  # noqa: F401 - re-exported to the commands

RecipeArg = typer.Argument(..., help="Path to a YAML recipe.", show_default=False)
OverridesArg = typer.Argument(None, help="Overrides as dotted key=value, e.g. epochs=1 optimizer.lr=0.01.", show_default=False)


def bad_input(message: str) -> typer.Exit:
    err.print(f"[red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(EXIT_INPUT)


@contextlib.contextmanager
def recipe_errors() -> Iterator[None]:
    """Every recipe problem listed at once on stderr, exit code 2, no traceback."""
    from mpsrun.recipe import RecipeError

    try:
        yield
    except RecipeError as e:
        err.print(e.render(), highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(EXIT_INPUT) from None


def resolve_recipe(recipe: Path, overrides: list[str] | None):  # type: ignore[no-untyped-def]
    from mpsrun.plugins import resolve

    with recipe_errors():
        return resolve(recipe, overrides or [])


def cells(resolved):  # type: ignore[no-untyped-def]
    """Every matrix cell, validated; exit 2 listing each bad value at its matrix entry."""
    from mpsrun.recipe.matrix import expand

    if not resolved.recipe.matrix:
        return []
    with recipe_errors():
        return expand(resolved)


def one_cell(resolved):  # type: ignore[no-untyped-def]
    from mpsrun.recipe.matrix import single

    with recipe_errors():
        return single(resolved)


def require_store(tracking_uri: str | None) -> None:
    """Refuse (exit 2, no traceback) a tracking server that does not answer, before any data loads."""
    import os

    from mpsrun.track.store import remote

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return  # the embedded store: opened (and locked) when the run starts
    try:
        remote.require_reachable(uri)
    except remote.Unreachable as e:
        raise bad_input(str(e)) from None
