"""The `mpsrun` command: parses, calls, prints, sets exit codes. Nothing else.

Exit codes: 0 done, 2 bad input (recipe, override, CLI, unusable device, missing
data), 1 failure while running, 130 interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator, List, Optional

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


@contextlib.contextmanager
def _recipe_errors() -> Iterator[None]:
    """Every recipe problem listed at once on stderr, exit code 2, no traceback."""
    from mpsrun.recipe import RecipeError

    try:
        yield
    except RecipeError as e:
        err.print(e.render(), highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(EXIT_INPUT) from None


def _resolve(recipe: Path, overrides: list[str] | None):  # type: ignore[no-untyped-def]
    from mpsrun.plugins import resolve

    with _recipe_errors():
        return resolve(recipe, overrides or [])


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
    resolved = _one_cell(_resolve(recipe, overrides))  # a matrix pinned to one cell runs; more: use bench
    from mpsrun.train import runner
    from mpsrun.train.progress import BarProgress, QuietProgress

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
    cells = _cells(resolved)
    console.print(f"# {recipe}: valid", highlight=False)
    console.print(resolved.as_yaml(), highlight=False, markup=False)
    if cells:
        console.print(f"# matrix: {len(cells)} cells x {resolved.recipe.repeats} repeats, each valid (run them: mpsrun bench {recipe})", highlight=False)
        for c in cells:
            console.print(f"#   {c.index + 1}: {c.label}", highlight=False, markup=False)


plugins_app = typer.Typer(help="List and inspect model and dataset plugins.", invoke_without_command=True)
app.add_typer(plugins_app, name="plugins")


@plugins_app.callback()
def plugins_list(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    kind: Optional[str] = typer.Option(None, "--kind", help="Only this kind: model or dataset."),
) -> None:
    """List installed model and dataset plugins with distribution and parameters."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.markup import escape

    from mpsrun.plugins import registry as plugins

    if kind not in (None, "model", "dataset"):
        raise _bad_input(f"--kind must be model or dataset, not '{kind}'")
    rows = [r for k in ("model", "dataset") if kind in (None, k) for r in plugins.describe_all(k)]
    if as_json:
        print(json.dumps([{k: v for k, v in r.items() if k != "doc"} for r in rows], indent=2))
        return
    table = Table(title="mpsrun plugins")
    for col in ("kind", "name", "distribution", "parameters", "summary"):
        table.add_column(col, overflow="fold")
    for r in rows:  # escape: type hints such as list[int] are not rich markup
        info = f"[red]{escape(r['error'])}[/]" if r["error"] else escape(r["summary"])
        table.add_row(r["kind"], r["name"], f"{r['distribution']} {r['version']}", escape(r["signature"]), info)
    console.print(table)


@plugins_app.command("show")
def plugins_show(name: str = typer.Argument(..., help="Plugin name, or distribution:name.")) -> None:
    """Show one plugin in full: where it comes from, its parameters and its docstring."""
    from mpsrun.plugins import registry as plugins

    found = [r for kind in ("model", "dataset") for r in plugins.describe_all(kind) if plugins.matches(r, name)]
    if not found:
        allnames = plugins.names("model") + plugins.names("dataset")
        from mpsrun.recipe.problems import did_you_mean

        raise _bad_input(f"no plugin named '{name}'{did_you_mean(name, allnames)}")
    for r in found:
        head = f"{r['kind']} {r['name']}  from {r['distribution']} {r['version']}  ({r['entry_point']})"
        console.print(head, style="bold", highlight=False, markup=False, soft_wrap=True)
        if r["error"]:
            console.print(r["error"], style="red", highlight=False, markup=False)
            continue
        console.print(f"  parameters: {r['signature'] or '(none)'}", highlight=False, markup=False, soft_wrap=True)
        if r["filled"]:
            console.print(f"  filled in by the runner: {', '.join(r['filled'])}", highlight=False, markup=False, soft_wrap=True)
        console.print("\n" + (r["doc"] or "(no docstring)") + "\n", highlight=False, markup=False)
    for kind in ("model", "dataset"):
        dists = sorted({r["distribution"] for r in found if r["kind"] == kind})
        if len(dists) > 1:
            picks = " or ".join(f"{d}:{found[0]['name']}" for d in dists)
            console.print(f"note: several distributions register {kind} '{found[0]['name']}'; a recipe must name {picks}", highlight=False, markup=False, soft_wrap=True)


@app.command()
def ui(
    port: int = typer.Option(5000, "--port", help="Port to serve on (127.0.0.1)."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="Store to browse; default as for `run`."),
) -> None:
    """Start the MLflow UI on the same store `mpsrun run` writes to."""
    import subprocess
    import sys

    from mpsrun.track import store as tracking

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
    from mpsrun.devices import doctor as doc

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


@app.command()
def parity(
    recipe: Path = RecipeArg,
    overrides: Optional[List[str]] = OverridesArg,
    devices: str = typer.Option(
        ..., "--devices", help="Two devices to compare, e.g. cpu,cuda; the first is the reference. The same device twice is a self-check.", show_default=False
    ),
    steps: int = typer.Option(20, "--steps", min=1, help="Training steps on each device."),
    atol: Optional[float] = typer.Option(None, "--atol", min=0.0, help="Absolute differences up to this always pass; default by precision: fp32 1e-6, bf16 and fp16 1e-5."),
    rtol: Optional[float] = typer.Option(None, "--rtol", min=0.0, help="Floor of the allowed relative difference ||B-A||/||A||; default by precision: fp32 1e-3, bf16 1e-2, fp16 2e-3."),
    noise_factor: Optional[float] = typer.Option(
        None, "--noise-factor", min=0.0, help="Also allow this many times the precision's own noise, measured by a higher-precision CPU replica (default 4; 0: fixed tolerances, no extra replica)."
    ),
    experiment: Optional[str] = typer.Option(None, "--experiment", help="MLflow experiment; default: the recipe's."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI; default as for `run`."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No line per step; only the summary."),
) -> None:
    """Check that two devices compute the same training: loss, gradients, logits, weights. Exit 0 agree, 1 diverge."""
    resolved = _resolve(recipe, overrides)
    from mpsrun.devices.parity import run as par
    from mpsrun.train import runner

    def line(rec: "par.StepRecord") -> None:
        if quiet:
            return
        d = rec.diffs
        parts = [f"step {rec.step:<3}"]
        if rec.loss is not None:
            parts.append(f"loss {rec.loss[0]:.6f} vs {rec.loss[1]:.6f}  rel diff: loss {d['loss'].rel:.0e} grad {d['grad_norm'].rel:.0e}")
        else:
            parts.append("(initial weights)  rel diff:")
        parts.append(f"logits {d['logits'].rel:.0e}")
        bad = rec.exceeded()
        parts.append(f"[red]OVER: {', '.join(bad)}[/]" if bad else "[green]ok[/]")
        console.print(" ".join(parts), highlight=False, soft_wrap=True)

    try:
        names = par.parse_devices(devices)
        console.print(f"[bold]mpsrun parity[/] {recipe}  devices {names[0]} (reference) vs {names[1]}  steps {steps}", highlight=False, soft_wrap=True)
        result = par.run(resolved, names, steps, atol, rtol, noise_factor, experiment, tracking_uri, line)
    except runner.InputError as e:
        raise _bad_input(str(e)) from None
    except KeyboardInterrupt:
        err.print("[yellow]interrupted:[/] the MLflow run is marked KILLED")
        raise typer.Exit(EXIT_INTERRUPT) from None
    except par.ParityFailed as e:
        err.print(f"[red]failed:[/] {e} (MLflow run {e.run_id} marked FAILED)", highlight=False)
        raise typer.Exit(EXIT_FAIL) from None
    tol = result.tolerance
    table = Table(title=f"{result.devices[0]} vs {result.devices[1]}, {result.precision}, {result.steps} steps")
    for col in ("quantity", "max abs diff", "max rel diff", "max noise", "worst / tolerance", "first step over"):
        table.add_column(col)
    for q, s in result.summary().items():
        first = "-" if s.first_step is None else str(s.first_step)
        table.add_row(q, f"{s.max_abs:.3g}", f"{s.max_rel:.3g}", f"{s.max_noise:.3g}", f"{s.max_ratio:.3g}", first)
    console.print(table)
    noise = f"a {result.yardstick} replica against {result.devices[0]}" if result.tolerance.noise_factor else "off"
    console.print(
        f"out of tolerance: abs diff > {tol.atol:g} and rel diff > max({tol.rtol:g}, {tol.noise_factor:g} x noise); "
        f"rel diff = ||B-A||/||A|| (params: against A's update); noise: {noise}",
        highlight=False,
        soft_wrap=True,
    )
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    if result.verdict == "agree":
        console.print(f"[green]verdict: agree[/] ({result.devices[1]} matches {result.devices[0]} within tolerance)", highlight=False)
    else:
        console.print(f"[red]verdict: diverge[/] first at {result.divergence_text()} (worst parameter: {result.worst_param})", highlight=False, soft_wrap=True)
    if result.run is not None:
        console.print(f"MLflow: {result.run.ui_hint()}  (browse: mpsrun ui)", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_OK if result.verdict == "agree" else EXIT_FAIL)


@app.command()
def schema() -> None:
    """Print the recipe JSON Schema, for editors: mpsrun schema > recipe.schema.json."""
    from mpsrun.recipe.schema import render

    print(render(), end="")


new_app = typer.Typer(help="Start something new from a template.", no_args_is_help=True)
app.add_typer(new_app, name="new")


@new_app.command("plugin")
def new_plugin(
    name: str = typer.Argument(..., help="Package (distribution) name, e.g. my-lab-models.", show_default=False),
    directory: Optional[Path] = typer.Option(None, "--dir", help="Folder to create; default: ./NAME.", show_default=False),
    model: Optional[str] = typer.Option(None, "--model", help="Entry-point name of the example model; default: MODULE_mlp.", show_default=False),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Entry-point name of the example dataset; default: MODULE_spirals.", show_default=False),
) -> None:
    """Write a plugin package (one model, one dataset, a recipe, tests), ready for pip install -e."""
    from mpsrun.plugins import scaffold

    dest = directory if directory is not None else Path(name)
    try:
        names = scaffold.Names.make(name, model, dataset)
        scaffold.write(dest, names)
    except scaffold.ScaffoldError as e:
        raise _bad_input(str(e)) from None
    console.print(f"wrote {dest}/: model '{names.model}', dataset '{names.dataset}' (package {names.dist}, module {names.module})", highlight=False, markup=False)
    console.print(f"next:\n  cd {dest}\n  pip install -e .\n  mpsrun run recipes/{names.dataset}.yaml", highlight=False, markup=False)


def _cells(resolved):  # type: ignore[no-untyped-def]
    """Every matrix cell, validated; exit 2 listing each bad value at its matrix entry."""
    from mpsrun.recipe.matrix import expand

    if not resolved.recipe.matrix:
        return []
    with _recipe_errors():
        return expand(resolved)


def _one_cell(resolved):  # type: ignore[no-untyped-def]
    from mpsrun.recipe.matrix import single

    with _recipe_errors():
        return single(resolved)


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
) -> None:
    """Run every cell of the recipe's `matrix:` (x `repeats:`) as child runs of one MLflow run; print the speed-up table.

    Exit 0 when every cell ran, 1 when any failed (the table says which, the child run holds the error).
    """
    resolved = _resolve(recipe, overrides)
    from rich.markup import escape

    from mpsrun.bench import compare as comparemod
    from mpsrun.bench import matrix_run as benchmod
    from mpsrun.train.engine import Listener
    from mpsrun.train.progress import QuietProgress

    try:
        with _recipe_errors():
            plan = benchmod.plan(resolved, baseline)
    except benchmod.BenchInputError as e:
        raise _bad_input(str(e)) from None

    class Notes(Listener):
        def on_note(self, message: str) -> None:
            console.print(f"      [yellow]warning:[/] {message}", highlight=False, soft_wrap=True)

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
    try:
        result = benchmod.run(plan, tracking_uri, Printer(), out)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted:[/] the bench's parent run and the running cell are marked KILLED; "
                  "`mpsrun compare` shows what finished")
        raise typer.Exit(EXIT_INTERRUPT) from None
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
    from mpsrun.track import store as tracking

    if baseline is not None and baseline not in ("cpu", "mps", "cuda", "none"):
        raise _bad_input(f"--baseline must be cpu, mps, cuda or none, not '{baseline}'")
    uri, _ = tracking.resolve_uri(tracking_uri)
    try:
        table = comparemod.load(uri, target, baseline)
    except comparemod.CompareError as e:
        raise _bad_input(str(e)) from None
    comparemod.render(table, console)
    if out is not None:
        comparemod.write(table, out)
        console.print(f"wrote results.csv, results.md, results.png to {out}", highlight=False)


def main() -> None:
    """Console-script entry point; maps a stray Ctrl-C to exit 130."""
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        raise SystemExit(EXIT_INTERRUPT) from None
