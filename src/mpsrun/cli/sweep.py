"""`sweep`: search a recipe's `sweep:` section with Optuna; each trial a child run of one parent run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from mpsrun.cli.common import OverridesArg, RecipeArg, app, bad_input, console, err, recipe_errors, require_store, resolve_recipe


@app.command()
def sweep(
    recipe: Path = RecipeArg,
    overrides: Optional[List[str]] = OverridesArg,
    trials: Optional[int] = typer.Option(None, "--trials", min=1, show_default=False, help="Finished trials the study should hold; default: the recipe's sweep.trials."),
    workers: int = typer.Option(1, "--workers", min=1, help="Trials at once on this machine (one GPU each where there are several; else torch threads divided)."),
    storage: Optional[str] = typer.Option(None, "--storage", show_default=False, help="Optuna storage: postgresql://... for workers on several machines; default: a journal file beside the MLflow store."),
    study: Optional[str] = typer.Option(None, "--study", show_default=False, help="Study name; default: the recipe's tracking.experiment, else its file name. The same name continues the same study."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI; default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns/mlflow.db."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the summary at the end."),
    gpu_sharing: str = typer.Option(
        "auto", "--gpu-sharing",
        help="Workers sharing one NVIDIA GPU: auto (start a private NVIDIA MPS daemon for the sweep where "
             "nvidia-cuda-mps-control is installed and none runs, so their kernels run at once; else they take turns, said), "
             "nvidia-mps (the same, an error if it cannot start), time-slicing (never start one)."),
) -> None:
    """Search the recipe's `sweep:` section with Optuna; every trial an MLflow child run of one parent run."""
    from mpsrun.sweep import trace

    trace.mark("command")
    resolved = resolve_recipe(recipe, overrides)
    if resolved.recipe.matrix:
        raise bad_input("a recipe with `matrix:` cannot be swept: run its cells with `mpsrun bench`, or drop the matrix")
    from mpsrun.sweep import drive, gpu_share

    if gpu_sharing not in gpu_share.SHARING:
        raise bad_input(f"--gpu-sharing {gpu_sharing!r}: choose one of {', '.join(gpu_share.SHARING)}")
    with recipe_errors():
        p = drive.plan(resolved, trials, workers, storage, study, tracking_uri)
    trace.mark("planned")
    require_store(tracking_uri)
    from mpsrun.train.keep import interrupt

    try:
        # From here a SIGINT/SIGTERM ends the command cleanly (its workers, helper and daemon stopped, a parent run
        # already open marked KILLED) with the exit code `run` gives; once the workers train, drive.run handles them.
        with interrupt.stop_on_signals():
            _start_and_run(p, quiet, gpu_sharing)
    except KeyboardInterrupt as e:
        err.print(f"[red]stopped:[/] interrupted ({getattr(e, 'name', 'SIGINT')})", highlight=False)
        raise typer.Exit(interrupt.exit_code(e)) from None


def _start_and_run(p, quiet: bool, gpu_sharing: str) -> None:  # type: ignore[no-untyped-def]
    """The private MPS daemon, the extra workers and worker 0's helper started first, then the sweep; all stopped after."""
    from mpsrun.sweep import drive, worker

    try:
        daemon = drive.share_gpu(p, gpu_sharing)
    except ValueError as e:
        raise bad_input(str(e)) from None
    early = tracker = None
    handed: list = []  # type: ignore[type-arg]
    try:
        early = drive.launch(p) if p.workers > 1 else None  # loading while this command opens the study and the parent run
        # Worker 0's MLflow helper, now: its set-up takes seconds. MPSRUN_SWEEP_EARLY_HELPER=0 starts it when worker 0
        # starts, after the study and the parent run (for measuring what starting it early buys: sweep_bench.py).
        if os.environ.get("MPSRUN_SWEEP_EARLY_HELPER", "1") != "0":
            tracker = worker.start_tracker(p.resolved, p.tracking_uri)
            handed.append(tracker)
            from mpsrun.sweep import trace

            trace.mark("helper_started")
        run_plan(p, quiet, early, handed)
    finally:
        if handed and tracker is not None:  # the command ended before worker 0 took it over
            tracker.close(wait=False)
        if early is not None:
            early.abandon()
        if daemon is not None:
            daemon.stop()
            from mpsrun.sweep import trace

            trace.mark("daemon_stopped")


def run_plan(p, quiet: bool, early=None, handed: Optional[list] = None) -> None:  # type: ignore[no-untyped-def,type-arg]
    """Open the study and its parent run, run the workers, print progress and the result; exits with its code."""
    from mpsrun.sweep import drive, head, parent, storage, trace, worker

    # torch, worker 0's data and a fused group's first compiles, on a thread while the study and the parent run open
    head.start(p.resolved, p.workers, p.target, lambda: worker.placement(p.resolved, 0, p.workers))
    try:
        study = drive.create_study(p)
    except Exception as e:  # noqa: BLE001 - a database that does not answer, a journal we cannot write
        raise bad_input(f"cannot open the Optuna storage {storage.shown(p.storage_url)}: {type(e).__name__}: {e}") from None
    trace.mark("study_opened")
    from mpsrun.sweep.fused.stop import held

    via = parent.Via(handed[0]) if handed else None  # the parent's MLflow calls in worker 0's helper: no mlflow import here
    opened = None
    began: list[bool] = []
    try:
        # A signal while the parent run is being created waits until its id is known (a second one does not): else a
        # SIGTERM between its creation and this command knowing it left it RUNNING with no owner (seen on 2 cores).
        with held():
            opened = parent.open_parent(p.resolved, study, p.storage_url, p.target, p.tracking_uri, via)
        trace.mark("parent_opened")
        _run_opened(p, quiet, early, handed, study, opened, began, via)
    except KeyboardInterrupt:  # a signal before the workers began (drive.run handles those after): the parent is not left RUNNING
        if opened is not None and opened.generation is not None and not began:
            parent.close(p.tracking_uri, opened.run_id, "KILLED", opened.generation, via)
        raise


def _run_opened(p, quiet: bool, early, handed, study, opened, began: list, via=None) -> None:  # type: ignore[no-untyped-def,type-arg]
    import time

    from mpsrun.sweep import drive, parent, results, storage

    parent_id, new = opened.run_id, opened.new
    before = results.summarise(p.resolved, study)
    sw = p.resolved.recipe.sweep
    console.print(
        f"[bold]mpsrun sweep[/] {p.resolved.path}  study '{p.study}' ({storage.shown(p.storage_url)})  "
        f"{'new' if new else f'continued: {before.done} of {p.target} trials done'}  "
        f"sampler={sw.sampler} pruner={sw.pruner} {sw.metric} ({sw.direction()})  workers={p.workers}  parent run {parent_id}",
        highlight=False, soft_wrap=True,
    )
    if opened.generation is None:
        console.print(f"[yellow]note:[/] joining as extra workers: {opened.message}; the owner publishes the results and closes the parent "
                      "(or this command does, if it ends last)", highlight=False, soft_wrap=True)
    elif opened.message:
        console.print(f"[yellow]note:[/] {opened.message}", highlight=False, soft_wrap=True)
    for note in p.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    parent.notes(p.tracking_uri, parent_id, p.notes, via)
    start = time.monotonic()

    def on_end(end, study) -> None:  # type: ignore[no-untyped-def]
        s = results.summarise(p.resolved, study)
        parent.progress(p.tracking_uri, parent_id, s.done, p.target, via)
        if quiet:
            return
        o = end.outcome
        what = f"{sw.metric} {o.value:.6g}" if o.value is not None else o.message[:120]
        best = f"best {s.best_value:.6g} (trial {s.best_number}: {_values(s.best_values)})" if s.best_value is not None else "no best yet"
        console.print(
            f"trial {end.number} {o.state} {what} in {end.seconds:.1f} s | done {s.done}/{p.target}: "
            f"{s.complete} complete, {s.pruned} pruned, {s.failed} failed | {best} {drive.eta(start, before.done, s.done, p.target)}",
            highlight=False, soft_wrap=True,
        )

    tracker = handed.pop() if handed else None  # worker 0 owns (and closes) the helper started for it
    began.append(True)
    out = drive.run(p, study, parent_id, on_end, opened.generation, early, tracker)
    # Every record is written (worker 0's MLflow helper answered `finish`, the other workers have exited, the parent's
    # writes were direct): the command ends without Python's teardown of torch and CUDA (2.4 s on 2 cores and on the H100).
    import mpsrun.cli.common as cli_common

    cli_common.END_WITHOUT_FINALISATION = True
    s = out.summary
    for note in out.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    console.print(
        f"sweep: {s.done} trials ({s.complete} complete, {s.pruned} pruned, {s.failed} failed"
        f"{f', {s.lost} lost and retried' if s.lost else ''}) in {time.monotonic() - start:.1f} s",
        highlight=False,
    )
    if s.best_value is not None:
        console.print(f"best: {sw.metric} {s.best_value:.6g}  trial {s.best_number}  {_values(s.best_values)}  (run {s.best_run_id})", highlight=False, soft_wrap=True)
        console.print("best recipe: the parent run's best_recipe.yaml (mpsrun run it to train the best trial again)", highlight=False)
    console.print(f"MLflow: parent run {parent_id}  (browse: mpsrun ui; continue: mpsrun resume {parent_id})", highlight=False)
    if out.message:
        err.print(f"[red]{'error' if out.exit_code == 2 else 'stopped'}:[/] {out.message}", highlight=False, soft_wrap=True)
    if out.exit_code:
        raise typer.Exit(out.exit_code)


def _values(values: dict) -> str:  # type: ignore[type-arg]
    import json

    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())



def resume_sweep(run, overrides: list, tracking_uri: Optional[str], quiet: bool) -> None:  # type: ignore[no-untyped-def,type-arg]
    """`mpsrun resume PARENT_ID`: the same recipe, overrides, study and storage, until the study holds its trials.

    The budget is the one the sweep last ran with (`mpsrun.sweep.trials`), or `sweep.trials=N` given here.
    """
    import json

    from mpsrun.sweep import drive, parent

    tags = run.data.tags
    recipe = Path(tags.get("mpsrun.recipe", ""))
    if not recipe.is_file():
        raise bad_input(
            f"the sweep's recipe {recipe} is not here; its text is the parent run's artifact sweep_recipe.yaml: "
            f"save it and run `mpsrun sweep FILE --study {tags.get(parent.STUDY)} --storage {tags.get(parent.STORAGE)}`"
        )
    resolved = resolve_recipe(recipe, json.loads(tags.get(parent.OVERRIDES, "[]")) + list(overrides))
    with recipe_errors():
        target = None if any(o.startswith("sweep.trials=") for o in overrides) else int(tags.get(parent.TARGET, "0")) or None
        p = drive.plan(resolved, target, 1, tags.get(parent.STORAGE), tags.get(parent.STUDY), tracking_uri)
    require_store(tracking_uri)
    run_plan(p, quiet)
