"""`run`, `validate`, `schema`: a recipe from file to finished run, or checked and printed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape  # error texts hold brackets (gloo's [file:line]), not markup

from mpsrun.cli.common import (
    EXIT_FAIL,
    EXIT_INTERRUPT,
    OverridesArg,
    RecipeArg,
    app,
    bad_input,
    cells,
    console,
    err,
    one_cell,
    require_store,
    resolve_recipe,
)

@app.command()
def run(
    recipe: Path = RecipeArg,
    overrides: Optional[List[str]] = OverridesArg,
    tracking_uri: Optional[str] = typer.Option(
        None, "--tracking-uri", help="MLflow tracking URI; default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns/mlflow.db."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="One line per epoch instead of progress bars."),
    nproc: int = typer.Option(
        1, "--nproc", min=1, help="Data-parallel ranks on this machine through torch.distributed (gloo on cpu, NCCL on cuda, "
        "one GPU per rank); batch_size stays the global batch. Across machines: torchrun ... -m mpsrun run RECIPE.",
    ),
) -> None:
    """Train a recipe and record metrics, timings and device facts in MLflow."""
    resolved = one_cell(resolve_recipe(recipe, overrides))  # a matrix pinned to one cell runs; more: use bench
    if resolved.recipe.sweep is not None:  # trains the recipe's own values, as if the section were not there
        from mpsrun.recipe.sweep import without_sweep

        resolved = without_sweep(resolved)
        err.print(f"[yellow]note:[/] the recipe's `sweep:` section is ignored by `mpsrun run`: it trains the recipe's own values "
                  f"(search them with: mpsrun sweep {recipe})", highlight=False, soft_wrap=True)
    require_store(tracking_uri)  # an unreachable server: exit 2 in seconds, before any data loads
    if nproc > 1:  # N copies of this command, started by torch's elastic agent (as torchrun does)
        from mpsrun.cli.ranks import launch_ranks

        return launch_ranks(resolved, recipe, overrides or [], tracking_uri, quiet, nproc)
    # MLflow set-up starts now, beside the torch import, data and model (track/helper/background.py).
    # Not in a rank of a multi-process job (RANK and WORLD_SIZE > 1, as train.distributed.from_env
    # reads them; not imported here, it imports torch): there train.job_run.tracker decides who logs.
    tracker = None
    if not ("RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1")):
        from mpsrun.track.helper import background
        from mpsrun.track.store import client as store

        uri, artifact_root = store.resolve_uri(tracking_uri)
        try:
            tracker = background.start(uri, resolved.recipe.tracking.experiment or resolved.path.stem, artifact_root, device=resolved.recipe.device,
                                       export_ahead=resolved.recipe.tracking.log_model, accelerator=_likely_accelerator(resolved.recipe.device),
                                       draw_ahead=resolved.recipe.tracking.figures)
        except background.TrackingSetupError as e:
            raise bad_input(str(e)) from None
    from mpsrun.train import runner
    from mpsrun.train.progress import BarProgress, QuietProgress, quality

    try:
        setup = runner.prepare(resolved)
    except runner.InputError as e:
        if tracker is not None:
            tracker.close(wait=False)
        raise bad_input(str(e)) from None
    except BaseException:
        if tracker is not None:
            tracker.close(wait=False)
        raise
    r = setup.resolved.recipe
    from mpsrun.train.ranks.distributed import is_main_process

    if not is_main_process():  # ranks 1..N-1 of a job train silently; rank 0 speaks for the job
        return _other_rank(setup, tracking_uri)
    console.print(
        f"[bold]mpsrun[/] {recipe}  model={r.model.name} dataset={r.dataset.name} "
        f"device={setup.choice.device} (requested {r.device})  epochs={r.epochs} batch={r.batch_size}  "
        f"data={'placed after a measured step' if setup.plan.pending else setup.plan.path}  precision={setup.options.precision} "
        f"graphs={'on' if setup.options.graphs else 'off'}",
        highlight=False,
    )
    progress = QuietProgress(console) if quiet or not console.is_terminal else BarProgress(console)
    from mpsrun.track.helper.background import TrackingSetupError
    from mpsrun.train.keep import interrupt

    import mpsrun.cli.common as cli_common

    cli_common.END_WITHOUT_FINALISATION = tracker is not None  # records complete when the command ends (helper's `finish` answered)
    try:
        with interrupt.stop_on_signals():  # SIGINT/SIGTERM: checkpoint, flush, KILLED, exit 130/143
            summary = runner.execute(setup, tracking_uri, progress, tracker=tracker)
    except TrackingSetupError as e:
        if tracker is not None:
            tracker.close(wait=False)
        if isinstance(progress, BarProgress):
            progress.stop()
        raise bad_input(str(e)) from None
    except KeyboardInterrupt as e:
        if isinstance(progress, BarProgress):
            progress.stop()
        err.print(f"[yellow]interrupted ({getattr(e, 'name', 'SIGINT')}):[/] the MLflow run is marked KILLED; "
                  "`mpsrun runs` shows the command to resume it", highlight=False)
        raise typer.Exit(interrupt.exit_code(e)) from None
    except runner.RunFailed as e:
        if isinstance(progress, BarProgress):
            progress.stop()
        err.print(f"[red]failed:[/] {escape(str(e))} (MLflow run {e.run_id} marked FAILED, traceback in its error.txt)", highlight=False)
        raise typer.Exit(EXIT_FAIL) from None
    res = summary.result
    if res.stop_reason and isinstance(progress, BarProgress):
        progress.stop()  # the bar stops itself only after the planned last epoch
    s = res.summary()
    if res.stop_reason:
        console.print(f"stopped: {res.stop_reason}", highlight=False)
    console.print(
        f"done: {quality(res.epochs[-1])}  first epoch {s['first_epoch_time_s']:.3f} s  "
        f"steady epoch {s['steady_epoch_time_s']:.3f} s (median of {max(len(res.epochs) - 1, 1)})  "
        f"total {s['total_train_time_s']:.2f} s  peak memory {s['peak_memory_bytes'] / 2**20:.0f} MiB",
        highlight=False,
    )
    test = {k: v for k, v in summary.test_metrics.items() if k != "test_size"}
    if test:  # the held-out test split, evaluated once with the weights the run logs
        n = int(summary.test_metrics.get("test_size", 0))
        console.print("test: " + "  ".join(f"{k} {v:.4g}" for k, v in test.items()) + f"  ({n} samples)", highlight=False)
    console.print(f"MLflow: {summary.run.ui_hint()}  (browse: mpsrun ui)", highlight=False)
    if summary.model_uri:
        console.print(f"model: {summary.model_uri}  (evaluate: mpsrun eval {summary.run.run_id})", highlight=False)


def _likely_accelerator(device: str | None) -> bool:
    """Whether the recipe's device will likely be a GPU, known before torch is imported (the exporter
    process wants fewer cores then): a CUDA or MPS device, or `auto` where the NVIDIA driver lists a
    GPU or on macOS (MPS)."""
    from mpsrun.plugins.nvidia import visible_gpus
    from mpsrun.track.helper.background import may_run_on_mps

    kind = (device or "auto").split(":")[0]
    if kind in ("cuda", "mps"):
        return True
    return kind == "auto" and (bool(visible_gpus()) or may_run_on_mps(device))


def _other_rank(setup, tracking_uri: Optional[str]) -> None:  # type: ignore[no-untyped-def]
    from mpsrun.train import runner

    try:
        runner.execute(setup, tracking_uri, None)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPT) from None
    except runner.RunFailed as e:
        err.print(f"[red]failed:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(EXIT_FAIL) from None


@app.command()
def validate(recipe: Path = RecipeArg, overrides: Optional[List[str]] = OverridesArg) -> None:
    """Check a recipe (and overrides) and print it resolved, or every problem found."""
    resolved = resolve_recipe(recipe, overrides)
    matrix_cells = cells(resolved)
    if resolved.recipe.sweep is not None:  # every searched value checked as `mpsrun sweep` checks it
        from mpsrun.cli.common import recipe_errors
        from mpsrun.sweep.drive import check

        with recipe_errors():
            check(resolved)
    console.print(f"# {recipe}: valid", highlight=False)
    console.print(resolved.as_yaml(), highlight=False, markup=False)
    if matrix_cells:
        console.print(f"# matrix: {len(matrix_cells)} cells x {resolved.recipe.repeats} repeats, each valid (run them: mpsrun bench {recipe})", highlight=False)
        for c in matrix_cells:
            console.print(f"#   {c.index + 1}: {c.label}", highlight=False, markup=False)


@app.command()
def schema() -> None:
    """Print the recipe JSON Schema, for editors: mpsrun schema > recipe.schema.json."""
    from mpsrun.recipe.schema import render

    print(render(), end="")
