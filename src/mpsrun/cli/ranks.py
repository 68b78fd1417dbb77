"""`mpsrun run R --nproc N`: the launcher side (checks, start the ranks, report how the job ended)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mpsrun.cli.common import EXIT_OK, bad_input, console, err


def launch_ranks(resolved, recipe: Path, overrides: list[str], tracking_uri: Optional[str], quiet: bool, nproc: int) -> None:  # type: ignore[no-untyped-def]
    """Fail fast on what no rank could run (exit 2), then start N ranks of the same command and wait."""
    from mpsrun.train import launch

    r = resolved.recipe
    try:
        backend = launch.precheck(r.device, r.device_fallback, r.batch_size, nproc)
    except launch.LaunchInputError as e:
        raise bad_input(str(e)) from None
    args = [str(recipe), *overrides]
    if tracking_uri:
        args += ["--tracking-uri", tracking_uri]
    if quiet:
        args.append("--quiet")
    console.print(
        f"[bold]mpsrun[/] launching {nproc} ranks ({backend}) through torch.distributed's elastic agent; "
        f"global batch {r.batch_size} = {nproc} x {r.batch_size // nproc}",
        highlight=False,
    )
    out = launch.launch(args, nproc, tracking_uri)
    if out.exit_code == EXIT_OK:
        return
    run = f" (MLflow run {out.run_id})" if out.run_id else ""
    err.print(f"[red]job failed:[/] {out.message}{run}", highlight=False, soft_wrap=True)
    raise typer.Exit(out.exit_code)
