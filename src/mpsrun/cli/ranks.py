"""`mpsrun run R --nproc N`, `mpsrun resume ID` of a multi-rank run: the launcher side.

Checks that no rank could pass fail fast here (exit 2), then the ranks are started
by torch's elastic agent (train/ranks/launch.py) and the job's outcome is reported.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape  # error texts hold brackets (gloo's [file:line]), not markup

from mpsrun.cli.common import EXIT_OK, bad_input, console, err


def in_a_job() -> bool:
    """This process is one rank of a multi-process job (RANK and WORLD_SIZE > 1, as a launcher sets them).

    Read from the environment, not train.distributed: that imports torch.
    """
    return "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1")


def launch_ranks(resolved, recipe: Path, overrides: list[str], tracking_uri: Optional[str], quiet: bool, nproc: int) -> None:  # type: ignore[no-untyped-def]
    """`run --nproc N`: N ranks of the same command."""
    start_job(resolved, [str(recipe), *overrides], tracking_uri, quiet, nproc, "run")


def start_job(resolved, args: list[str], tracking_uri: Optional[str], quiet: bool, nproc: int, command: str, env: dict[str, str] | None = None, headline: str = "") -> None:  # type: ignore[no-untyped-def]
    """Fail fast on what no rank could run (exit 2), then start N ranks of `mpsrun <command> *args` and wait."""
    from mpsrun.train.ranks import launch

    r = resolved.recipe
    try:
        backend = launch.precheck(r.device, r.device_fallback, r.batch_size, nproc)
    except launch.LaunchInputError as e:
        raise bad_input(str(e)) from None
    args = list(args)
    if tracking_uri:
        args += ["--tracking-uri", tracking_uri]
    if quiet:
        args.append("--quiet")
    console.print(
        f"[bold]mpsrun[/] {headline}launching {nproc} ranks ({backend}) through torch.distributed's elastic agent; "
        f"global batch {r.batch_size} = {nproc} x {r.batch_size // nproc}",
        highlight=False,
    )
    out = launch.launch(args, nproc, tracking_uri, command, env)
    if out.exit_code == EXIT_OK:
        return
    run = f" (MLflow run {out.run_id})" if out.run_id else ""
    err.print(f"[red]job failed:[/] {escape(str(out.message))}{run}", highlight=False, soft_wrap=True)
    raise typer.Exit(out.exit_code)
