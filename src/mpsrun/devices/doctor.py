"""`mpsrun doctor`: one screen that says which backend will train here and why the others won't.

The report is a plain dict so ``--json`` output and the Rich rendering come from
the same data, and scripts/CI can assert on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpsrun.devices import sysinfo

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console

# Preference when several backends work: a discrete NVIDIA GPU beats Apple's, both beat CPU.
_PREFERENCE: tuple[str, ...] = ("cuda", "mps", "cpu")


def recommended_device(backends: dict[str, dict[str, Any]]) -> str:
    """First usable backend in preference order; CPU is the floor."""
    for name in _PREFERENCE:
        if backends.get(name, {}).get("usable"):
            return name
    return "cpu"


def build_report() -> dict[str, Any]:
    """Collect every backend's status and the software stack as JSON-ready data."""
    backends: dict[str, dict[str, Any]] = {}
    for name in sysinfo.BACKENDS:
        try:
            backends[name] = sysinfo.backend_status(name).to_dict()
        except Exception as exc:  # noqa: BLE001 - a crashing probe is itself a diagnosis
            backends[name] = sysinfo.BackendStatus(
                name,
                False,
                f"probing {name} raised {type(exc).__name__}: {exc}",
                "report this as an mpsrun bug, with the output of `python -m torch.utils.collect_env`",
                {},
            ).to_dict()
    return {
        "backends": backends,
        "software": sysinfo.software_versions(),
        "recommended_device": recommended_device(backends),
    }


def render(report: dict[str, Any], console: Console) -> None:
    """Print the report: a table per backend (✓/✗, reason, hint, facts), then software."""
    from rich.padding import Padding
    from rich.table import Table

    def kv_table() -> Table:
        table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 2))
        table.add_column("key", style="dim", no_wrap=True, min_width=27)
        table.add_column("value", overflow="fold")
        return table

    recommended = report.get("recommended_device", "cpu")
    for name, st in report.get("backends", {}).items():
        usable = bool(st.get("usable"))
        mark = "[bold green]✓[/]" if usable else "[bold red]✗[/]"
        verdict = "[green]usable[/]" if usable else "[red]unusable[/]"
        star = "  [cyan](recommended)[/]" if name == recommended else ""
        console.print(f"{mark} [bold]{name}[/] {verdict}{star}")
        table = kv_table()
        if st.get("reason"):
            table.add_row("reason", f"[red]{st['reason']}[/]")
        if st.get("hint"):
            table.add_row("hint", f"[yellow]{st['hint']}[/]")
        for key, value in (st.get("details") or {}).items():
            table.add_row(str(key), str(value))
        console.print(Padding(table, (0, 0, 0, 2)))

    console.print("[bold]software[/]")
    sw = kv_table()
    for pkg, ver in report.get("software", {}).items():
        sw.add_row(str(pkg), f"[red]{ver}[/]" if ver == "absent" else str(ver))
    console.print(Padding(sw, (0, 0, 0, 2)))
    console.print(f"recommended device: [bold cyan]{recommended}[/]")
