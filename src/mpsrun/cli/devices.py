"""`ui`, `doctor`, `parity`: the store browser and the device checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from mpsrun.cli.common import (
    EXIT_FAIL,
    EXIT_INTERRUPT,
    EXIT_OK,
    EXIT_TERM,
    OverridesArg,
    RecipeArg,
    app,
    bad_input,
    console,
    err,
    require_store,
    resolve_recipe,
)

@app.command()
def ui(
    port: int = typer.Option(5000, "--port", help="Port to serve on (127.0.0.1)."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="Store to browse; default as for `run`."),
    experiment: Optional[str] = typer.Option(
        None, "--experiment", "-e", help="Experiment whose training runs the printed link opens; default: the one with the most recent run."
    ),
) -> None:
    """Start the MLflow UI on the same store `mpsrun run` writes to. Ctrl-C / SIGTERM stop it (exit 130 / 143).

    Says "starting..." at once and prints the link when the server answers.
    """
    from mpsrun.track.store import client as tracking
    from mpsrun.track import ui_server

    uri, artifacts = tracking.resolve_uri(tracking_uri)
    base = f"http://127.0.0.1:{port}"
    log = ui_server.log_path(uri, port)
    console.print(f"starting the MLflow UI for {uri} on port {port} (server log: {log})...", highlight=False, soft_wrap=True)
    chosen: dict[str, str] = {}

    def choose() -> None:  # once the server answers: its store exists (a new one is created by the server alone)
        try:
            chosen["id"], chosen["name"] = ui_server.choose_experiment(uri, experiment)
        except LookupError:
            from mpsrun.recipe.problems import did_you_mean

            raise bad_input(f"no experiment '{experiment}' in {uri}{did_you_mean(experiment or '', ui_server.experiment_names(uri))}") from None
        except Exception as e:  # noqa: BLE001 - the store could not be read here: the link opens the UI's home page
            err.print(f"[yellow]warning:[/] could not choose an experiment ({type(e).__name__}: {e}); the link opens the UI's home page",
                      highlight=False, markup=True)

    def started() -> None:  # while the server starts (tens of seconds on a small machine)
        ui_server.warm(uri)
        if experiment is not None and ui_server.store_exists(uri):  # a misspelt name: exit 2 now, not once the server is up
            choose()

    def ready() -> None:
        chosen["answered"] = "yes"
        if "id" not in chosen:
            choose()
        link = ui_server.experiment_page(base, chosen.get("id"))
        name = f"experiment '{chosen['name']}'; " if "name" in chosen else ""
        console.print(f"MLflow UI: {link}  ({name}Ctrl-C to stop)", highlight=False, soft_wrap=True)

    code = ui_server.serve(ui_server.command(uri, artifacts, "127.0.0.1", port), url=base, on_ready=ready, on_started=started, log=log)
    if code in (EXIT_INTERRUPT, EXIT_TERM):
        err.print("stopped: the MLflow UI server has exited", highlight=False)
    elif "answered" not in chosen:  # it ended before answering (a port in use, a store it cannot open): its own words
        err.print(f"[red]failed:[/] the MLflow UI server exited ({code}) before answering; the end of {log}:\n{ui_server.tail(log)}",
                  highlight=False, markup=True, soft_wrap=True)
        code = EXIT_FAIL
    raise typer.Exit(code)


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
            raise bad_input(f"unknown device '{device}' (expected cpu, mps or cuda)")
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
    """Check that two devices compute the same training: loss, gradients, logits (a regression's predictions), weights. Exit 0 agree, 1 diverge.

    Steps use the recipe's own loss for its task and its grad_clip.
    """
    resolved = resolve_recipe(recipe, overrides)
    require_store(tracking_uri)
    from mpsrun.devices.parity import run as par
    from mpsrun.train import runner

    outputs = "logits"  # "outputs" for a regression recipe: its probe compares predictions

    def line(rec: "par.StepRecord") -> None:
        nonlocal outputs
        if rec.argmax_agreement is None:
            outputs = "outputs"
        if quiet:
            return
        d = rec.diffs
        parts = [f"step {rec.step:<3}"]
        if rec.loss is not None:
            parts.append(f"loss {rec.loss[0]:.6f} vs {rec.loss[1]:.6f}  rel diff: loss {d['loss'].rel:.0e} grad {d['grad_norm'].rel:.0e}")
        else:
            parts.append("(initial weights)  rel diff:")
        parts.append(f"{outputs} {d['logits'].rel:.0e}")
        bad = rec.exceeded()
        parts.append(f"[red]OVER: {', '.join(bad)}[/]" if bad else "[green]ok[/]")
        console.print(" ".join(parts), highlight=False, soft_wrap=True)

    try:
        names = par.parse_devices(devices)
        console.print(f"[bold]mpsrun parity[/] {recipe}  devices {names[0]} (reference) vs {names[1]}  steps {steps}", highlight=False, soft_wrap=True)
        result = par.run(resolved, names, steps, atol, rtol, noise_factor, experiment, tracking_uri, line)
    except runner.InputError as e:
        raise bad_input(str(e)) from None
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
        table.add_row(result.label(q), f"{s.max_abs:.3g}", f"{s.max_rel:.3g}", f"{s.max_noise:.3g}", f"{s.max_ratio:.3g}", first)
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
