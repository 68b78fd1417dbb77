"""The results table of a bench, built from MLflow alone.

`mpsrun bench` prints this table from its finished runs through the very same code
`mpsrun compare` uses later, so every figure on screen, in the CSV, the Markdown
and the chart can be traced to measured child runs in the store.

Speed-up is the ratio of training throughput (train samples per second over the
steady epochs) against the same cell on the baseline device. Throughput, not
epoch time, because a slow device may run a smaller subset (an `include` entry);
with equal data the two ratios agree.
"""

from __future__ import annotations

import csv
import json
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpsrun.recipe.matrix import fmt_value
from mpsrun.track.records import names as mlflow_names

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console

EPOCH = "steady_epoch_time_s"
THROUGHPUT = "steady_train_samples_per_s"
ACCURACY = "final_val_accuracy"
FIRST = "first_epoch_time_s"


class CompareError(Exception):
    """Nothing to compare (unknown experiment or run, not a bench): exit code 2."""


@dataclass
class ChildRun:
    """One child run of a bench, as MLflow holds it."""

    run_id: str
    status: str
    index: int
    repeat: int
    values: dict[str, Any]
    requested: str
    actual: str | None
    metrics: dict[str, float]
    train_size: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED" and EPOCH in self.metrics


def _spread(xs: list[float]) -> tuple[float | None, float | None, float | None]:
    if not xs:
        return None, None, None
    return statistics.median(xs), min(xs), max(xs)


@dataclass
class Row:
    """One matrix cell: its runs over the repeats, summarised."""

    index: int
    values: dict[str, Any]
    axes: list[str]
    runs: list[ChildRun] = field(default_factory=list)
    speedup: float | None = None

    @property
    def ok_runs(self) -> list[ChildRun]:
        return [r for r in self.runs if r.ok]

    def metric(self, key: str) -> tuple[float | None, float | None, float | None]:
        return _spread([r.metrics[key] for r in self.ok_runs if key in r.metrics])

    @property
    def device(self) -> str:
        """The device that ran (as recorded), else the one asked for."""
        actual = sorted({r.actual for r in self.ok_runs if r.actual})
        if actual:
            return ",".join(actual)
        asked = self.values.get("device") or (self.runs[0].requested if self.runs else "")
        return str(asked)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def requested(self) -> str:
        return str(self.values.get("device") or (self.runs[0].requested if self.runs else ""))

    @property
    def fell_back(self) -> bool:
        req = self.requested.split(":")[0]
        return bool(self.ok_runs) and req not in ("", "auto") and req != self.device_type

    @property
    def extras(self) -> dict[str, Any]:
        return {k: v for k, v in self.values.items() if k not in self.axes}

    @property
    def train_size(self) -> int | None:
        sizes = [r.train_size for r in self.runs if r.train_size is not None]
        return sizes[0] if sizes else None

    @property
    def group(self) -> tuple:
        """Cells that differ only in device share a group; speed-ups are within it."""
        return tuple((a, json.dumps(self.values.get(a), sort_keys=True)) for a in self.axes if a != "device")

    @property
    def status(self) -> str:
        if not self.runs:
            return "not run"
        bad = [r for r in self.runs if not r.ok]
        if not bad:
            return "ok"
        first = bad[0]
        if first.error:
            why = first.error.splitlines()[0]
        else:
            why = "interrupted" if first.status == "KILLED" else "no steady-epoch figures recorded"
        why = why.removeprefix("InputError: ").split(". ")[0]  # the whole error is on the child run
        if len(why) > 90:
            why = why[:87] + "..."
        head = first.status if first.status != "FINISHED" else "INCOMPLETE"
        if len(bad) == len(self.runs):
            return f"{head}: {why}"
        return f"{len(bad)}/{len(self.runs)} {head}: {why}"


@dataclass
class Table:
    experiment: str
    parent_id: str
    recipe: str
    axes: list[str]
    baseline: str | None
    repeats: int
    rows: list[Row]

    @property
    def device_types(self) -> list[str]:
        seen: list[str] = []
        for r in self.rows:
            if r.device_type and r.device_type not in seen:
                seen.append(r.device_type)
        return seen

    @property
    def has_speedup(self) -> bool:
        return self.baseline is not None and len(self.device_types) > 1

    @property
    def failed(self) -> int:
        return sum(1 for r in self.rows if r.status != "ok")

    @property
    def quality(self) -> tuple[str, str]:
        """(header, metric): val accuracy, or for a regression bench (no accuracy logged) its val R^2."""
        runs = [c for r in self.rows for c in r.ok_runs]
        regression = runs and not any(ACCURACY in c.metrics for c in runs) and any("val_r2" in c.metrics for c in runs)
        return ("val r2", "val_r2") if regression else ("val acc", ACCURACY)


def compute_speedups(rows: list[Row], baseline: str | None) -> None:
    """Throughput of each cell over that of the same cell on the baseline device."""
    for r in rows:
        r.speedup = None
    if baseline is None:
        return
    base: dict[tuple, float] = {}
    for r in rows:
        sps = r.metric(THROUGHPUT)[0]
        if r.device_type == baseline and sps:
            base.setdefault(r.group, sps)
    for r in rows:
        sps = r.metric(THROUGHPUT)[0]
        b = base.get(r.group)
        if sps and b:
            r.speedup = sps / b


def build_rows(axes: list[str], children: list[ChildRun], plan: list[dict[str, Any]] | None = None) -> list[Row]:
    """Group child runs by cell, in the bench's planned order (planned cells not run included)."""
    rows: dict[int, Row] = {}
    for p in plan or []:
        rows[int(p["index"])] = Row(int(p["index"]), dict(p["values"]), axes)
    for c in children:
        row = rows.setdefault(c.index, Row(c.index, dict(c.values), axes))
        row.runs.append(c)
    for row in rows.values():
        row.runs.sort(key=lambda r: r.repeat)
    return [rows[i] for i in sorted(rows)]


# ----------------------------------------------------------------------------- MLflow


def _client(uri: str) -> Any:
    from mpsrun.track.store import client as tracking

    return tracking.client(uri)


def find_parent(c: Any, target: str) -> Any:
    """The bench parent run named by `target`: a parent's or child's run id, or an experiment (its latest bench)."""
    from mlflow.exceptions import MlflowException

    run = None
    try:
        run = c.get_run(target)
    except MlflowException:
        run = None
    except Exception:  # noqa: BLE001 - odd ids upset some stores
        run = None
    if run is not None:
        kind = run.data.tags.get("mpsrun.bench")
        if kind == "parent":
            return run
        if kind == "child" and run.data.tags.get("mlflow.parentRunId"):
            return c.get_run(run.data.tags["mlflow.parentRunId"])
        raise CompareError(f"run {target} is not part of an `mpsrun bench` (no mpsrun.bench tag)")
    exp = c.get_experiment_by_name(target)
    if exp is None:
        names = [e.name for e in c.search_experiments()]
        from mpsrun.recipe.problems import did_you_mean

        raise CompareError(f"no experiment and no run named '{target}'{did_you_mean(target, names)}")
    runs = c.search_runs(
        [exp.experiment_id], filter_string="tags.`mpsrun.bench` = 'parent'", order_by=["attributes.start_time DESC"], max_results=1
    )
    if not runs:
        raise CompareError(f"experiment '{target}' has no `mpsrun bench` runs")
    return runs[0]


def _child(run: Any) -> ChildRun:
    t = run.data.tags
    size = run.data.params.get("data.train_size")
    return ChildRun(
        run_id=run.info.run_id,
        status=run.info.status,
        index=int(t.get("bench.cell_index", -1)),
        repeat=int(t.get("bench.repeat", 0)),
        values=json.loads(t.get("bench.cell", "{}")),
        requested=t.get("device.requested", ""),
        actual=t.get("device.actual") if t.get("device.actual") not in (None, "none") else None,
        metrics=mlflow_names.from_mlflow(run.data.metrics),  # system/steady_epoch_time_s -> steady_epoch_time_s
        train_size=int(size) if size and size.isdigit() else None,
        error=t.get("mpsrun.error"),
    )


def _plan(c: Any, run_id: str) -> list[dict[str, Any]] | None:
    try:
        with tempfile.TemporaryDirectory() as d:
            path = c.download_artifacts(run_id, "plan.json", d)
            return json.loads(Path(path).read_text())["cells"]
    except Exception:  # noqa: BLE001 - older or partial benches: children alone
        return None


def load(uri: str, target: str, baseline: str | None = None) -> Table:
    """Rebuild a bench's table from the store; `baseline` None means the one the bench used."""
    c = _client(uri)
    parent = find_parent(c, target)
    pid = parent.info.run_id
    tags = parent.data.tags
    children = c.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{pid}'", max_results=50000
    )
    axes = json.loads(tags.get("bench.axes", "[]"))
    rows = build_rows(axes, [_child(r) for r in children if r.data.tags.get("mpsrun.bench") == "child"], _plan(c, pid))
    chosen = tags.get("bench.baseline", "none") if baseline is None else baseline
    chosen = None if chosen in ("none", "") else chosen
    if chosen is not None and chosen not in {r.device_type for r in rows}:
        raise CompareError(f"baseline '{chosen}' ran no cell of this bench (devices: {', '.join(sorted({r.device_type for r in rows}))})")
    compute_speedups(rows, chosen)
    exp = c.get_experiment(parent.info.experiment_id).name
    return Table(exp, pid, tags.get("bench.recipe", ""), axes, chosen, int(tags.get("bench.repeats", 1)), rows)


# ----------------------------------------------------------------------------- output


def _num(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "—"
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.{digits}f}"


def _short_names(keys: list[str]) -> dict[str, str]:
    """`model.arch` -> `arch` where the last part is unambiguous (narrower columns and labels)."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def columns(table: Table) -> tuple[list[str], list[list[str]]]:
    """Headers and cells as text: the one rendering behind the console, Markdown and `compare`."""
    shown_axes = [a for a in table.axes if a != "device"]
    extras = any(r.extras for r in table.rows)
    headers = list(shown_axes) + ["device"]
    if extras:
        headers.append("also set")
    headers += ["train n", "runs", "epoch s (median)", "epoch s (min–max)", "samples/s"]
    if table.has_speedup:
        headers.append(f"speed-up vs {table.baseline}")
    headers += [table.quality[0], "status"]
    body = []
    for r in table.rows:
        med, lo, hi = r.metric(EPOCH)
        sps = r.metric(THROUGHPUT)[0]
        acc = r.metric(table.quality[1])[0]
        dev = r.device + (f" (asked {r.requested})" if r.fell_back else "")
        line = [fmt_value(r.values[a]) if a in r.values else "—" for a in shown_axes] + [dev]
        if extras:
            line.append(" ".join(f"{k}={fmt_value(v)}" for k, v in r.extras.items()) or "—")
        line += [
            str(r.train_size) if r.train_size is not None else "—",
            f"{len(r.ok_runs)}/{len(r.runs)}",
            _num(med),
            f"{_num(lo)}–{_num(hi)}" if len(r.ok_runs) > 1 else "—",
            _num(sps, 1),
        ]
        if table.has_speedup:
            line.append(f"{r.speedup:.2f}x" if r.speedup is not None else "—")
        line += [f"{acc:.4f}" if acc is not None else "—", r.status]
        body.append(line)
    return headers, body


def caption(table: Table) -> str:
    rep = f"median over {table.repeats} repeats" if table.repeats > 1 else "one run per cell"
    s = (
        f"Steady epoch = epochs after the first (warm-up), device synchronised; {rep}. "
        f"samples/s = training throughput in the steady epochs."
    )
    if table.has_speedup:
        s += f" Speed-up = samples/s over the same cell's samples/s on {table.baseline}."
    return s


def to_markdown(table: Table) -> str:
    headers, body = columns(table)

    def esc(x: str) -> str:
        return x.replace("|", "\\|")

    lines = [
        f"# {table.experiment}: bench {table.parent_id}",
        "",
        f"Recipe: `{table.recipe}`. {caption(table)}",
        "",
        "| " + " | ".join(esc(h) for h in headers) + " |",
        "|" + "|".join(" --- " for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def to_csv(table: Table, path: Path) -> None:
    """Raw numbers (not rounded) for spreadsheets and scripts."""
    base = table.baseline or "baseline"
    fields = ["cell", *table.axes, "device", "device_requested", "also_set", "train_size", "runs_ok", "runs",
              "steady_epoch_time_s_median", "steady_epoch_time_s_min", "steady_epoch_time_s_max",
              "train_samples_per_s_median", "train_samples_per_s_min", "train_samples_per_s_max",
              f"speedup_vs_{base}", "first_epoch_time_s_median", f"{table.quality[1]}_median", "status", "run_ids"]
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(fields)
        for r in table.rows:
            e, s, f, a = r.metric(EPOCH), r.metric(THROUGHPUT), r.metric(FIRST), r.metric(table.quality[1])
            w.writerow(
                [r.index, *[fmt_value(r.values[x]) if x in r.values else "" for x in table.axes], r.device, r.requested,
                 " ".join(f"{k}={fmt_value(v)}" for k, v in r.extras.items()), r.train_size if r.train_size is not None else "",
                 len(r.ok_runs), len(r.runs), *[x if x is not None else "" for x in e], *[x if x is not None else "" for x in s],
                 r.speedup if r.speedup is not None else "", f[0] if f[0] is not None else "", a[0] if a[0] is not None else "",
                 r.status, " ".join(x.run_id for x in r.runs)]
            )


def plot(table: Table, path: Path) -> None:
    """Grouped bars of throughput per cell and device, speed-ups written on the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [a for a in table.axes if a != "device"]
    short = _short_names(shown)
    groups: list[tuple] = []
    labels: dict[tuple, str] = {}
    for r in table.rows:
        if r.group not in labels:
            groups.append(r.group)
            labels[r.group] = "\n".join(f"{short[a]}={fmt_value(r.values[a])}" for a in shown if a in r.values) or "all"
    devs = table.device_types or ["?"]
    width = 0.8 / len(devs)
    fig_w = min(max(6.0, 0.9 * len(groups) * max(len(devs), 1) * 0.75 + 2.5), 24.0)
    fig, ax = plt.subplots(figsize=(fig_w, 5.0), dpi=110)
    colors = plt.get_cmap("tab10").colors
    values = [r.metric(THROUGHPUT)[0] for r in table.rows if r.metric(THROUGHPUT)[0]]
    top = max(values) if values else 1.0
    log = bool(values) and top / max(min(values), 1e-9) > 30
    for di, dev in enumerate(devs):
        xs, hs, lo, hi, notes = [], [], [], [], []
        for gi, g in enumerate(groups):
            row = next((r for r in table.rows if r.group == g and r.device_type == dev), None)
            if row is None:
                continue
            x = gi + (di - (len(devs) - 1) / 2) * width
            med, mn, mx = row.metric(THROUGHPUT)
            if med is None:
                ax.text(x, (min(values) if log and values else 0) or 0, "failed" if row.runs else "not run",
                        rotation=90, ha="center", va="bottom", fontsize=8, color="crimson")
                continue
            xs.append(x)
            hs.append(med)
            lo.append(med - mn)
            hi.append(mx - med)
            notes.append("" if row.speedup is None or dev == table.baseline else f"{row.speedup:.1f}x")
        if not xs:
            ax.bar([], [], width, label=dev, color=colors[di % len(colors)])
            continue
        bars = ax.bar(xs, hs, width, label=dev, color=colors[di % len(colors)],
                      yerr=[lo, hi] if table.repeats > 1 else None, capsize=3)
        for b, note in zip(bars, notes):
            if note:
                ax.annotate(note, (b.get_x() + b.get_width() / 2, b.get_height()), xytext=(0, 3),
                            textcoords="offset points", ha="center", va="bottom", fontsize=8, fontweight="bold")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([labels[g] for g in groups], fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel("training samples / s (higher is better)")
    title = f"{table.experiment}: steady-epoch training throughput"
    if table.has_speedup:
        title += f", speed-up vs {table.baseline} on the bars"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(title="device", fontsize=8)
    ax.margins(y=0.12)
    fig.text(0.01, 0.01, f"bench {table.parent_id}; {'median of %d repeats, bars: min–max' % table.repeats if table.repeats > 1 else 'one run per cell'}",
             fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def write(table: Table, folder: Path) -> dict[str, Path]:
    """results.csv, results.md and results.png in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"csv": folder / "results.csv", "md": folder / "results.md", "png": folder / "results.png"}
    to_csv(table, paths["csv"])
    paths["md"].write_text(to_markdown(table))
    plot(table, paths["png"])
    return paths


def render(table: Table, console: Console) -> None:
    """The table on screen: same headers and cells as the Markdown file."""
    from rich.markup import escape
    from rich.table import Table as RichTable

    headers, body = columns(table)
    t = RichTable(title=f"{table.experiment}: bench {table.parent_id}", caption=caption(table), caption_justify="left")
    numeric = {"train n", "runs", "epoch s (median)", "epoch s (min–max)", "samples/s", table.quality[0]} | {h for h in headers if h.startswith("speed-up")}
    for h in headers:
        t.add_column(h, justify="right" if h in numeric else "left", overflow="fold")
    for row in body:
        t.add_row(*[f"[red]{escape(c)}[/]" if h == "status" and c != "ok" else escape(c) for h, c in zip(headers, row)])
    if console.is_terminal:
        console.print(t)
        return
    # Logs and pipes: the table at its natural width, not folded into 80 columns.
    from rich.console import Console as RichConsole
    from rich.measure import Measurement

    width = max(console.width, Measurement.get(console, console.options.update(width=1000), t).maximum)
    RichConsole(file=console.file, width=width, no_color=console.no_color).print(t)
