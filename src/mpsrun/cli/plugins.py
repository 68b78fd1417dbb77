"""`plugins` and `new plugin`: what is installed, and a template for a new package."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from mpsrun.cli.common import (
    app,
    bad_input,
    console,
)

plugins_app = typer.Typer(help="List and inspect model and dataset plugins.", invoke_without_command=True)
app.add_typer(plugins_app, name="plugins")


@plugins_app.callback()
def plugins_list(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    kind: Optional[str] = typer.Option(None, "--kind", help="Only this kind: model, dataset, callback or loss."),
) -> None:
    """List installed plugins (models, datasets, callbacks, losses) with distribution and parameters."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.markup import escape

    from mpsrun.plugins import registry as plugins

    if kind not in (None, *plugins.GROUPS):
        raise bad_input(f"--kind must be model, dataset, callback or loss, not '{kind}'")
    rows = [r for k in plugins.GROUPS if kind in (None, k) for r in plugins.describe_all(k)]
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

    found = [r for kind in plugins.GROUPS for r in plugins.describe_all(kind) if plugins.matches(r, name)]
    if not found:
        allnames = [n for kind in plugins.GROUPS for n in plugins.names(kind)]
        from mpsrun.recipe.problems import did_you_mean

        raise bad_input(f"no plugin named '{name}'{did_you_mean(name, allnames)}")
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
        raise bad_input(str(e)) from None
    console.print(f"wrote {dest}/: model '{names.model}', dataset '{names.dataset}' (package {names.dist}, module {names.module})", highlight=False, markup=False)
    console.print(f"next:\n  cd {dest}\n  pip install -e .\n  mpsrun run recipes/{names.dataset}.yaml", highlight=False, markup=False)
