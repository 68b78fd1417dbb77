"""The `mpsrun` command: parses, calls, prints, sets exit codes. Nothing else.

Exit codes: 0 done, 2 bad input (recipe, override, CLI, unusable device, missing
data), 1 failure while running, 130 interrupted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="mpsrun",
    help="Train what a YAML recipe declares on MPS, CUDA or CPU, with honest timings, tracked in MLflow.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True)

EXIT_OK, EXIT_FAIL, EXIT_INPUT, EXIT_INTERRUPT = 0, 1, 2, 130

RecipeArg = typer.Argument(..., help="Path to a YAML recipe.", show_default=False)
OverridesArg = typer.Argument(None, help="Overrides as dotted key=value, e.g. epochs=1 optimizer.lr=0.01.", show_default=False)


def _bad_input(message: str) -> typer.Exit:
    err.print(f"[red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(EXIT_INPUT)


def _resolve(recipe: Path, overrides: list[str] | None):  # type: ignore[no-untyped-def]
    from .recipe import RecipeError, resolve

    try:
        return resolve(recipe, overrides or [])
    except RecipeError as e:
        err.print(e.render(), highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(EXIT_INPUT) from None


@app.command()
def run(
    recipe: Path = RecipeArg,
    overrides: Optional[List[str]] = OverridesArg,
    tracking_uri: Optional[str] = typer.Option(
        None, "--tracking-uri", help="MLflow tracking URI; default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns/mlflow.db."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="One line per epoch instead of progress bars."),
) -> None:
    """Train a recipe and record metrics, timings and device facts in MLflow."""
    resolved = _resolve(recipe, overrides)
    from . import runner
    from .progress import BarProgress, QuietProgress

    try:
        setup = runner.prepare(resolved)
    except runner.InputError as e:
        raise _bad_input(str(e)) from None
    r = setup.resolved.recipe
    console.print(
        f"[bold]mpsrun[/] {recipe}  model={r.model.name} dataset={r.dataset.name} "
        f"device={setup.choice.device} (requested {r.device})  epochs={r.epochs} batch={r.batch_size}  "
        f"data={'resident' if setup.plan.resident else 'dataloader'}  precision={setup.options.precision} "
        f"graphs={'on' if setup.options.graphs else 'off'}",
        highlight=False,
    )
    progress = QuietProgress(console) if quiet or not console.is_terminal else BarProgress(console)
    try:
        summary = runner.execute(setup, tracking_uri, progress)
    except KeyboardInterrupt:
        if isinstance(progress, BarProgress):
            progress.stop()
        err.print("[yellow]interrupted:[/] the MLflow run is marked KILLED")
        raise typer.Exit(EXIT_INTERRUPT) from None
    except runner.RunFailed as e:
        if isinstance(progress, BarProgress):
            progress.stop()
        err.print(f"[red]failed:[/] {e} (MLflow run {e.run_id} marked FAILED, traceback in its error.txt)", highlight=False)
        raise typer.Exit(EXIT_FAIL) from None
    res = summary.result
    s = res.summary()
    console.print(
        f"done: val_acc {s['final_val_accuracy']:.4f}  first epoch {s['first_epoch_time_s']:.3f} s  "
        f"steady epoch {s['steady_epoch_time_s']:.3f} s (median of {max(len(res.epochs) - 1, 1)})  "
        f"total {s['total_train_time_s']:.2f} s  peak memory {s['peak_memory_bytes'] / 2**20:.0f} MiB",
        highlight=False,
    )
    console.print(f"MLflow: {summary.run.ui_hint()}  (browse: mpsrun ui)", highlight=False)


@app.command()
def validate(recipe: Path = RecipeArg, overrides: Optional[List[str]] = OverridesArg) -> None:
    """Check a recipe (and overrides) and print it resolved, or every problem found."""
    resolved = _resolve(recipe, overrides)
    console.print(f"# {recipe}: valid", highlight=False)
    console.print(resolved.as_yaml(), highlight=False, markup=False)


plugins_app = typer.Typer(help="List and inspect model and dataset plugins.", invoke_without_command=True)
app.add_typer(plugins_app, name="plugins")


@plugins_app.callback()
def plugins_list(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """List installed model and dataset plugins with distribution and parameters."""
    if ctx.invoked_subcommand is not None:
        return
    from . import plugins

    rows = plugins.describe_all("model") + plugins.describe_all("dataset")
    if as_json:
        print(json.dumps([{k: v for k, v in r.items() if k != "doc"} for r in rows], indent=2))
        return
    table = Table(title="mpsrun plugins")
    for col in ("kind", "name", "distribution", "parameters", "summary"):
        table.add_column(col, overflow="fold")
    for r in rows:
        info = f"[red]{r['error']}[/]" if r["error"] else r["summary"]
        table.add_row(r["kind"], r["name"], f"{r['distribution']} {r['version']}", r["signature"], info)
    console.print(table)


@plugins_app.command("show")
def plugins_show(name: str = typer.Argument(..., help="Plugin name, or distribution:name.")) -> None:
    """Show one plugin in full: where it comes from, its parameters and its docstring."""
    from . import plugins

    found = []
    for kind in ("model", "dataset"):
        for r in plugins.describe_all(kind):
            if name in (r["name"], f"{r['distribution']}:{r['name']}"):
                found.append(r)
    if not found:
        allnames = plugins.names("model") + plugins.names("dataset")
        from .recipe import did_you_mean

        raise _bad_input(f"no plugin named '{name}'{did_you_mean(name, allnames)}")
    for r in found:
        console.print(f"[bold]{r['kind']} {r['name']}[/]  from {r['distribution']} {r['version']}  ({r['entry_point']})")
        if r["error"]:
            console.print(f"[red]{r['error']}[/]")
            continue
        console.print(f"  parameters: {r['signature'] or '(none)'}", highlight=False)
        console.print("\n" + (r["doc"] or "(no docstring)") + "\n", highlight=False, markup=False)


@app.command()
def ui(
    port: int = typer.Option(5000, "--port", help="Port to serve on (127.0.0.1)."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="Store to browse; default as for `run`."),
) -> None:
    """Start the MLflow UI on the same store `mpsrun run` writes to."""
    import subprocess
    import sys

    from . import tracking

    uri, artifacts = tracking.resolve_uri(tracking_uri)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)]
    if artifacts:
        cmd += ["--default-artifact-root", artifacts]
    console.print(f"MLflow UI for {uri} at http://127.0.0.1:{port}  (Ctrl-C to stop)", highlight=False)
    try:
        raise typer.Exit(subprocess.call(cmd))
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPT) from None


@app.command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    device: Optional[str] = typer.Option(None, "--device", help="Exit 1 unless this backend (cpu, mps, cuda) is usable."),
) -> None:
    """Say for each backend (cpu, mps, cuda) whether it is usable here and, if not, why."""
    from . import doctor as doc

    report = doc.build_report()
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        doc.render(report, console)
    if device is not None:
        kind = device.split(":")[0]
        if kind not in report["backends"]:
            raise _bad_input(f"unknown device '{device}' (expected cpu, mps or cuda)")
        if not report["backends"][kind]["usable"]:
            raise typer.Exit(EXIT_FAIL)


def main() -> None:
    """Console-script entry point; maps a stray Ctrl-C to exit 130."""
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        raise SystemExit(EXIT_INTERRUPT) from None
