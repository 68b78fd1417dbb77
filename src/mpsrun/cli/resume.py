"""`resume`, `runs`: continue an interrupted run in the same MLflow run; list runs with their real state."""

from __future__ import annotations

import json
import shutil
import time
from typing import List, Optional

import typer
from rich.markup import escape  # error texts hold brackets (gloo's [file:line]), not markup

from mpsrun.cli.common import EXIT_FAIL, EXIT_INTERRUPT, app, bad_input, console, err, recipe_errors

UriOpt = typer.Option(
    None, "--tracking-uri", help="MLflow tracking URI; default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns/mlflow.db."
)


def _resume_hint(run_id: str, tracking_uri: str | None) -> str:
    return f"mpsrun resume {run_id}" + (f" --tracking-uri {tracking_uri}" if tracking_uri else "")


@app.command()
def resume(
    run_id: str = typer.Argument(..., help="The MLflow run id to continue (see `mpsrun runs`).", show_default=False),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="Overrides on the run's logged recipe, e.g. epochs=30 to train a finished run further.", show_default=False
    ),
    tracking_uri: Optional[str] = UriOpt,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="One line per epoch instead of progress bars."),
    nproc: Optional[int] = typer.Option(
        None, "--nproc", min=1, show_default=False,
        help="Ranks to resume on; default: as many as the run trained on (its distributed.world_size tag). "
        "batch_size stays the global batch, so another count follows the same trajectory.",
    ),
) -> None:
    """Continue an interrupted run (KILLED, FAILED, or RUNNING with its process gone) from its last checkpoint.

    A data-parallel run resumes as a job of as many ranks as it trained on (`--nproc` to change that).
    """
    from mpsrun.cli.ranks import in_a_job
    from mpsrun.track.store import client as tracking
    from mpsrun.train.keep import resume as resumemod

    uri, _ = tracking.resolve_uri(tracking_uri)
    from mpsrun.track.store.runs import get_run

    found = get_run(uri, run_id)
    if found is not None and found.data.tags.get("mpsrun.sweep") == "parent":  # a sweep goes on: its study, its parent
        from mpsrun.cli.sweep import resume_sweep

        return resume_sweep(found, overrides or [], tracking_uri, quiet)
    if in_a_job():  # one rank of a resumed job: started below, or by torchrun ... -m mpsrun resume ID
        if nproc is not None:
            raise bad_input("--nproc inside a job that a launcher (torchrun) already started; drop --nproc")
        return _resume(uri, run_id, overrides or [], tracking_uri, quiet)
    try:
        with recipe_errors():
            p = resumemod.plan(uri, run_id, overrides or [])
    except resumemod.ResumeRefused as e:
        raise bad_input(str(e)) from None
    world = nproc or p.world_size
    note = resumemod.world_note(p.world_size, world)
    if note:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    if world == 1:
        return _resume(uri, run_id, overrides or [], tracking_uri, quiet, p)
    from mpsrun.cli.ranks import start_job

    r = p.resolved.recipe
    try:
        start_job(
            p.resolved, [run_id, *(overrides or [])], tracking_uri, quiet, world, "resume",
            env={resumemod.ENV_FILES: str(p.workdir)},  # rank 0 reads the checkpoint fetched here
            headline=f"resume {run_id} ({p.status}) experiment '{p.experiment}': epochs {p.point.start_epoch + 1}..{r.epochs}; ",
        )
    finally:
        shutil.rmtree(p.workdir, ignore_errors=True)


def _resume(uri: str, run_id: str, overrides: list[str], tracking_uri: Optional[str], quiet: bool, p=None) -> None:  # type: ignore[no-untyped-def]
    """Resume in this process: a single process (`p` planned already), or one rank of a job.

    Rank 0 plans in full (liveness, the checkpoint: from the launcher's folder, else the
    store); the other ranks read the recipe only and take rank 0's checkpoint once the
    group is joined, so only rank 0 fetches it and only its pid becomes the run's.
    """
    from mpsrun.train.ranks import distributed
    from mpsrun.train.keep import interrupt
    from mpsrun.train import runner
    from mpsrun.train.keep import resume as resumemod
    from mpsrun.train.progress import BarProgress, QuietProgress

    job = distributed.from_env()
    main = job is None or job.main
    if p is None:
        try:
            with recipe_errors():
                p = resumemod.plan(uri, run_id, overrides, checkpoint=main, files_dir=resumemod.files_from_env() if main else None)
        except resumemod.ResumeRefused as e:
            raise bad_input(str(e)) from None
    try:
        try:
            setup = runner.prepare(p.resolved)  # a rank joins the job's group here
        except runner.InputError as e:
            raise bad_input(str(e)) from None
        p.point.checkpoint = distributed.broadcast_object(p.point.checkpoint if main else None)
        if not main:  # ranks 1..N-1 train silently; rank 0 speaks for the job
            try:
                runner.execute(setup, tracking_uri, None, resume=p.point, experiment=p.experiment)
            except KeyboardInterrupt:
                raise typer.Exit(EXIT_INTERRUPT) from None
            except runner.RunFailed as e:
                err.print(f"[red]failed:[/] {escape(str(e))}", highlight=False)
                raise typer.Exit(EXIT_FAIL) from None
            return
        r = setup.resolved.recipe
        ranks = f" on {job.world_size} ranks" if job else ""
        console.print(
            f"[bold]mpsrun resume[/] {run_id} ({p.status}) experiment '{p.experiment}': epochs {p.point.start_epoch + 1}..{r.epochs} "
            f"of {r.epochs} on {setup.choice.device}{ranks}",
            highlight=False,
        )
        progress = QuietProgress(console) if quiet or not console.is_terminal else BarProgress(console)
        try:
            with interrupt.stop_on_signals():
                summary = runner.execute(setup, tracking_uri, progress, resume=p.point, experiment=p.experiment)
        except runner.OwnerConflict as e:  # another live process took the run first: it is named, the run untouched
            raise bad_input(escape(str(e))) from None
        except KeyboardInterrupt as e:
            if isinstance(progress, BarProgress):
                progress.stop()
            err.print(f"[yellow]interrupted ({getattr(e, 'name', 'SIGINT')}):[/] run {run_id} is marked KILLED; "
                      f"go on with: {_resume_hint(run_id, tracking_uri)}", highlight=False)
            raise typer.Exit(interrupt.exit_code(e)) from None
        except runner.RunFailed as e:
            if isinstance(progress, BarProgress):
                progress.stop()
            err.print(f"[red]failed:[/] {escape(str(e))} (MLflow run {e.run_id} marked FAILED, traceback in its error.txt)", highlight=False)
            raise typer.Exit(EXIT_FAIL) from None
    finally:
        shutil.rmtree(p.workdir, ignore_errors=True)
    from mpsrun.train.progress import quality  # the task's headline: accuracy, or R^2 and MAE

    s = summary.result.summary()
    console.print(f"done: {quality(summary.result.epochs[-1])}  val_loss {s['final_val_loss']:.4f}", highlight=False)
    console.print(f"MLflow: {summary.run.ui_hint()}  (browse: mpsrun ui)", highlight=False)


RUNS_COLUMNS = ("run id", "experiment", "name", "status", "device", "epochs/trials", "best", "started")


def _runs_cells(r) -> list[str]:  # type: ignore[no-untyped-def]
    done = "?" if r.epochs_done is None else str(r.epochs_done)
    planned = "?" if r.epochs_planned is None else str(r.epochs_planned)
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.start_time / 1000)) if r.start_time else ""
    progress = r.sweep or f"{done}/{planned}"  # a sweep's parent: trials done of its budget
    return [r.run_id, r.experiment, r.name, r.shown, r.device, progress, r.best, started]


def aligned(rows: list[list[str]]) -> list[str]:
    """Rows as lines, each column padded to its widest cell and two spaces apart; nothing cut or folded.

    An empty cell shows as "-", so a reader's eye (or `grep RUN_ID`) never meets a gap that
    shifts the columns.
    """
    rows = [[c if c.strip() else "-" for c in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


@app.command()
def runs(
    experiment: Optional[str] = typer.Option(None, "--experiment", "-e", help="Only this experiment's runs."),
    limit: int = typer.Option(20, "--limit", "-n", min=1, help="How many recent runs."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    tracking_uri: Optional[str] = UriOpt,
) -> None:
    """Recent runs with their real state: a RUNNING run whose process is gone shows as INTERRUPTED."""
    from mpsrun.track.store import client as tracking
    from mpsrun.track.store.runs import experiment_names, list_runs

    uri, _ = tracking.resolve_uri(tracking_uri)
    try:
        rows = list_runs(uri, experiment, limit)
    except LookupError:
        from mpsrun.recipe.problems import did_you_mean

        raise bad_input(f"no experiment '{experiment}' in {uri}{did_you_mean(experiment or '', experiment_names(uri))}") from None
    if as_json:
        print(json.dumps([{**r.as_dict(), "resume": _resume_hint(r.run_id, tracking_uri) if r.resumable else None} for r in rows], indent=2))
        return
    if not rows:
        console.print(f"no runs in {uri}", highlight=False)
        return
    cells = [_runs_cells(r) for r in rows]
    if console.is_terminal:
        from rich.table import Table

        t = Table(box=None, pad_edge=False)
        for col in RUNS_COLUMNS:
            t.add_column(col, no_wrap=col in ("run id", "status", "epochs/trials"), overflow="fold")
        colour = {"FINISHED": "green", "FAILED": "red", "KILLED": "yellow", "INTERRUPTED": "yellow", "RUNNING": "cyan"}
        for c in cells:
            t.add_row(*c[:3], f"[{colour.get(c[3], 'white')}]{c[3]}[/]", *c[4:])
        console.print(t)
    else:  # a pipe, a log, a file: plain aligned lines that grep, cut and awk can read, one per run
        for line in aligned([list(RUNS_COLUMNS), *cells]):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    for r in rows:
        if r.shown == "INTERRUPTED":
            console.print(f"{r.run_id}: RUNNING in MLflow but its process is gone ({r.why})", highlight=False, soft_wrap=True)
    todo = [r for r in rows if r.resumable]
    if todo:
        console.print("resume with:", highlight=False)
        for r in todo:
            console.print(f"  {_resume_hint(r.run_id, tracking_uri)}", highlight=False, soft_wrap=True)
