"""`bench` and `compare`: matrix runs and their speed-up table."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from mpsrun.cli.common import (
    EXIT_FAIL,
    RecipeArg,
    app,
    bad_input,
    console,
    err,
    recipe_errors,
    require_store,
    resolve_recipe,
)

@app.command()
def bench(
    recipe: Path = RecipeArg,
    overrides: Optional[List[str]] = typer.Argument(
        None,
        help="Overrides as dotted key=value. matrix.AXIS=\\[v1,v2] replaces an axis's values (matrix.device=\\[cpu,cuda]); "
        "AXIS=v pins an axis to one value.",
        show_default=False,
    ),
    baseline: Optional[str] = typer.Option(
        None, "--baseline", help="Device the speed-up is measured against: cpu, mps, cuda or none. Default: cpu when cells run there."
    ),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write results.csv, results.md and results.png to this folder."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI; default as for `run`."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="One line per epoch of every cell."),
    parallel: int = typer.Option(
        1, "--parallel", min=1, help="Run up to N cells at once, each in its own process (one GPU each via CUDA_VISIBLE_DEVICES; "
        "on the CPU they share the cores). Timings are then of cells sharing the machine (tag bench.parallel).",
    ),
) -> None:
    """Run every cell of the recipe's `matrix:` (x `repeats:`) as child runs of one MLflow run; print the speed-up table.

    Exit 0 when every cell ran, 1 when any failed (the table says which, the child run holds the error).
    """
    resolved = resolve_recipe(recipe, overrides)
    require_store(tracking_uri)
    from rich.markup import escape

    from mpsrun.bench import compare as comparemod
    from mpsrun.bench import matrix_run as benchmod
    from mpsrun.train.loop.engine import Listener
    from mpsrun.train.progress import QuietProgress

    try:
        with recipe_errors():
            plan = benchmod.plan(resolved, baseline)
    except benchmod.BenchInputError as e:
        raise bad_input(str(e)) from None

    class Notes(Listener):
        def on_note(self, message: str, warn: bool = True) -> None:
            console.print(f"      [yellow]warning:[/] {message}" if warn else f"      note: {message}", highlight=False, soft_wrap=True)

    class Printer(benchmod.BenchListener):
        def on_cell_start(self, n, total, cell, repeat):  # type: ignore[no-untyped-def]
            rep = f"  repeat {repeat + 1}/{plan.repeats}" if plan.repeats > 1 else ""
            console.print(f"[{n}/{total}] {cell.label or '(single cell)'}{rep}", highlight=False, markup=False, soft_wrap=True)
            return QuietProgress(console) if verbose else Notes()

        def on_cell_end(self, n, total, cell, repeat, ok, message):  # type: ignore[no-untyped-def]
            if ok:
                console.print(f"      {message}", highlight=False, markup=False, soft_wrap=True)
            else:
                err.print(f"      [red]FAILED[/] {escape(message)}", highlight=False, soft_wrap=True)

    base = f"  baseline {plan.baseline}" if plan.baseline else ""
    console.print(
        f"[bold]mpsrun bench[/] {recipe}: {len(plan.cells)} cells x {plan.repeats} repeats = {plan.total} runs, "
        f"experiment '{plan.experiment}'{base}",
        highlight=False,
        soft_wrap=True,
    )
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    from mpsrun.train.keep import interrupt

    runner_ = None
    parallel_notes: list[str] = []
    if parallel > 1:
        from mpsrun.bench import parallel as parallelmod

        runner_ = parallelmod.cells_runner(parallel, parallel_notes)
    try:
        with interrupt.stop_on_signals():  # SIGINT/SIGTERM: the running cell and the parent end KILLED, exit 130/143
            result = benchmod.run(plan, tracking_uri, Printer(), out, cells_runner=runner_, parallel=parallel)
    except KeyboardInterrupt as e:
        err.print(f"[yellow]interrupted ({getattr(e, 'name', 'SIGINT')}):[/] the bench's parent run and the running cell are marked KILLED; "
                  "`mpsrun compare` shows what finished")
        raise typer.Exit(interrupt.exit_code(e)) from None
    for note in parallel_notes:
        console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    comparemod.render(result.table, console)
    where = f" and in {out}" if out else ""
    console.print(f"results.csv, results.md, results.png: artifacts of parent run {result.parent.run_id}{where}", highlight=False, soft_wrap=True)
    console.print(f"MLflow: {result.parent.ui_hint()}  (again: mpsrun compare {result.parent.run_id})", highlight=False, soft_wrap=True)
    if result.failed:
        err.print(f"[red]{result.failed} of {len(result.table.rows)} cells failed[/] (see the status column)", soft_wrap=True)
        raise typer.Exit(EXIT_FAIL)


@app.command()
def compare(
    target: str = typer.Argument(..., help="Experiment name (its latest bench), or the run id of a bench's parent or of one of its cells.", show_default=False),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Device for the speed-up column (cpu, mps, cuda, none); default: the bench's."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write results.csv, results.md and results.png to this folder."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI; default as for `run`."),
) -> None:
    """Rebuild a bench's results table from MLflow alone and print it."""
    from mpsrun.bench import compare as comparemod
    from mpsrun.track.store import client as tracking

    if baseline is not None and baseline not in ("cpu", "mps", "cuda", "none"):
        raise bad_input(f"--baseline must be cpu, mps, cuda or none, not '{baseline}'")
    uri, _ = tracking.resolve_uri(tracking_uri)
    try:
        table = comparemod.load(uri, target, baseline)
    except comparemod.CompareError as e:
        raise bad_input(str(e)) from None
    comparemod.render(table, console)
    if out is not None:
        comparemod.write(table, out)
        console.print(f"wrote results.csv, results.md, results.png to {out}", highlight=False)
