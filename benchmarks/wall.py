"""Whole-process wall time of short runs against the floor of importing torch (issue 16).

A user waits for the whole process, not the training loop. In one command, on one
machine, alternating the commands round by round (so drift hits them all alike),
this times each command `--repeats` times and reports medians and ratios:

- floor: `python -c` that imports torch, builds a small model and takes one optimizer
  step on the device (the least any PyTorch training script pays);
- `mpsrun --help`;
- `mpsrun run recipes/digits_mlp.yaml epochs=1 device=cpu` (target: <= 1.5x the CPU floor);
- with `--helpers`, the same digits run with MPSRUN_MLFLOW_HELPER=process, thread, inline;
- on a CUDA machine, `mpsrun run recipes/fashion_mlp_mps.yaml device=cuda epochs=10`
  against the CUDA floor (target: <= the floor plus 3 s). Where FashionMNIST is not in
  `--fashion-root`, FashionMNIST-format files (gzip'd IDX, 60,000 / 10,000 images) are
  written with `mpsrun.testing.idx` first, and the table says so.

Every run uses one MLflow store in a temporary folder that an untimed warm-up round
creates first (a user's store already exists); with `--fresh`, every timed run starts in
a new empty folder and creates its own store (a first-time user's run). Writes a Markdown table to `--out` and,
with `--update-docs`, into docs/benchmarks.md's "Start-up" section.

    python benchmarks/wall.py --repeats 5 --out wall.md [--helpers] [--update-docs]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "benchmarks.md"
SECTION = "## Start-up: `benchmarks/wall.py` (issue 16)"

FLOOR = """
import torch
dev = torch.device({device!r})
m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(dev)
opt = torch.optim.Adam(m.parameters(), lr=1e-3)
x, y = torch.rand(32, 1, 8, 8, device=dev), torch.randint(0, 10, (32,), device=dev)
torch.nn.functional.cross_entropy(m(x), y).backward()
opt.step()
float(m(x).sum())  # waits for the device
"""


@dataclass
class Cmd:
    key: str
    label: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    baseline: str | None = None  # key of the command it is compared with
    times: list[float] = field(default_factory=list)
    failures: int = 0


def mpsrun_argv(*args: str) -> list[str]:
    exe = shutil.which("mpsrun", path=str(Path(sys.executable).parent)) or shutil.which("mpsrun")
    return [exe, *args] if exe else [sys.executable, "-m", "mpsrun", *args]


def timed(cmd: Cmd, cwd: Path, log) -> float | None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **cmd.env}
    env.pop("MLFLOW_TRACKING_URI", None)
    t = time.perf_counter()
    p = subprocess.run(cmd.argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t
    log.write(f"--- {cmd.key} rc={p.returncode} {wall:.3f}s\n{p.stdout[-3000:]}\n")
    if p.returncode != 0:
        print(f"  {cmd.key}: exit {p.returncode} (see the log)", file=sys.stderr)
        return None
    return wall


def machine() -> dict[str, str]:
    info = {"python": platform.python_version(), "os": f"{platform.system()} {platform.release()}", "cores": str(os.cpu_count())}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        info["cpu"] = platform.processor() or platform.machine()
    probe = "import torch; print(torch.__version__); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.split("\n")
    info["torch"], info["gpu"] = (out + ["?", "-"])[:2]
    return info


def fashion_root(arg: str | None, work: Path) -> tuple[Path, str]:
    root = Path(arg).expanduser().resolve() if arg else work / "data"
    raw = root / "FashionMNIST" / "raw"
    if all((raw / f).exists() or (raw / f"{f}.gz").exists() for f in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")):
        return root, f"FashionMNIST files in {root}"
    from mpsrun.testing.idx import write_idx_dataset

    write_idx_dataset(root, "FashionMNIST", n_train=60000, n_test=10000, seed=0)
    return root, "FashionMNIST-format synthetic data (gzip'd IDX, 60,000 / 10,000 images, `mpsrun.testing.idx`): the real files were absent"


def commands(cuda: bool, helpers: bool, root: Path | None, export_end: bool = False, baseline_src: Path | None = None) -> list[Cmd]:
    digits = str(REPO / "recipes" / "digits_mlp.yaml")
    cmds = [
        Cmd("floor_cpu", "floor: `python -c` import torch + one Adam step (cpu)", [sys.executable, "-c", FLOOR.format(device="cpu")]),
        Cmd("help", "`mpsrun --help`", mpsrun_argv("--help")),
        Cmd("digits", "`mpsrun run recipes/digits_mlp.yaml epochs=1 device=cpu`", mpsrun_argv("run", digits, "epochs=1", "device=cpu", "-q"), baseline="floor_cpu"),
    ]
    if helpers:
        for mode in ("process", "thread", "inline"):
            cmds.append(Cmd(f"digits_{mode}", f"the same, MPSRUN_MLFLOW_HELPER={mode}", cmds[2].argv, {"MPSRUN_MLFLOW_HELPER": mode}, baseline="floor_cpu"))
    if cuda and root is not None:
        fashion = str(REPO / "recipes" / "fashion_mlp_mps.yaml")
        cmds.append(Cmd("floor_cuda", "floor: `python -c` import torch + one Adam step (cuda)", [sys.executable, "-c", FLOOR.format(device="cuda")]))
        cmds.append(
            Cmd(
                "fashion",
                "`mpsrun run recipes/fashion_mlp_mps.yaml device=cuda epochs=10`",
                mpsrun_argv("run", fashion, "device=cuda", "epochs=10", f"dataset.root={root}", "dataset.download=false", "-q"),
                baseline="floor_cuda",
            )
        )
        if export_end:  # the model exported in the training process after the last epoch, as before the exporter process
            cmds.append(Cmd("fashion_end", "the same, the model exported at the end (`MPSRUN_EXPORT_AHEAD=0`)", cmds[-1].argv,
                            {"MPSRUN_EXPORT_AHEAD": "0"}, baseline="floor_cuda"))
        if baseline_src is not None:  # another commit's source tree first on the path: before and after in one call
            path = os.pathsep.join([str(baseline_src), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
            cmds.append(Cmd("fashion_base", f"the same, the source in `{baseline_src}` (the baseline commit)", cmds[-1 if not export_end else -2].argv,
                            {"PYTHONPATH": path}, baseline="floor_cuda"))
    return cmds


def table(cmds: list[Cmd], info: dict[str, str], repeats: int, notes: list[str], load: tuple[float, float]) -> str:
    by = {c.key: c for c in cmds}
    med = {c.key: statistics.median(c.times) for c in cmds if c.times}
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"### {now} — {info.get('cpu', '?')}, {info['cores']} cores, GPU {info['gpu']}",
        "",
        f"python {info['python']}, torch {info['torch']}, {info['os']}; medians of {repeats} alternating rounds; "
        f"load average {load[0]:.1f} before, {load[1]:.1f} after.",
        "",
        "| command | median wall s | min–max s | vs floor |",
        "| --- | --- | --- | --- |",
    ]
    for c in cmds:
        if not c.times:
            lines.append(f"| {c.label} | failed | | |")
            continue
        ratio = ""
        if c.baseline and c.baseline in med:
            ratio = f"{med[c.key] / med[c.baseline]:.2f}x (+{med[c.key] - med[c.baseline]:.2f} s)"
        fail = f" ({c.failures} failed)" if c.failures else ""
        lines.append(f"| {c.label} | {med[c.key]:.2f}{fail} | {min(c.times):.2f}–{max(c.times):.2f} | {ratio} |")
    lines.append("")
    targets = []
    if "digits" in med and "floor_cpu" in med:
        r = med["digits"] / med["floor_cpu"]
        targets.append(f"digits 1 epoch / CPU floor = {r:.2f} (target <= 1.5: {'met' if r <= 1.5 else 'NOT met'})")
    if "help" in med:
        targets.append(f"`mpsrun --help` = {med['help']:.2f} s (target <= 0.5 s: {'met' if med['help'] <= 0.5 else 'NOT met'})")
    if "fashion" in med and "floor_cuda" in med:
        d = med["fashion"] - med["floor_cuda"]
        targets.append(f"fashion 10 epochs on cuda = CUDA floor + {d:.2f} s (target <= +3 s: {'met' if d <= 3 else 'NOT met'})")
    lines += [f"- {t}" for t in targets + notes]
    return "\n".join(lines) + "\n"


def update_docs(block: str, provisional: bool) -> None:
    text = DOCS.read_text()
    head = (
        f"{SECTION}\n\nWhole-process wall time of short runs against the floor of importing torch and taking one\n"
        "optimizer step, measured side by side (alternating rounds, medians): "
        "`python benchmarks/wall.py --repeats 5 --helpers --out wall.md --update-docs`; on a CUDA\n"
        "machine `bash benchmarks/wall_gpu.sh`. Newest block first.\n\n"
    )
    mark = "**Provisional** (measured while other jobs loaded this machine; to be re-run on a quiet one).\n\n" if provisional else ""
    if SECTION in text:
        start = text.index(SECTION)
        nxt = text.find("\n## ", start + len(SECTION))
        body = text[start:] if nxt < 0 else text[start:nxt]
        old_blocks = body.split("\n### ", 1)
        rest = "### " + old_blocks[1] if len(old_blocks) > 1 else ""
        new = head + mark + block + ("\n" + rest if rest else "")
        text = text[:start] + new.rstrip("\n") + "\n" + ("" if nxt < 0 else text[nxt:])
    else:
        text = text.rstrip("\n") + "\n\n" + head + mark + block
    DOCS.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (medians over these); default 5")
    ap.add_argument("--out", type=Path, help="write the Markdown table here")
    ap.add_argument("--helpers", action="store_true", help="also time the digits run per MPSRUN_MLFLOW_HELPER mode")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA commands even where CUDA is present")
    ap.add_argument("--cuda-only", action="store_true", help="only the CUDA floor and the fashion run (a GPU machine's short round)")
    ap.add_argument("--fashion-root", help="folder holding FashionMNIST/raw (default: synthetic data in a temp folder)")
    ap.add_argument("--export-end", action="store_true", help="also time the fashion run with MPSRUN_EXPORT_AHEAD=0 (no exporter process)")
    ap.add_argument("--baseline-src", type=Path, help="also time the fashion run with this source folder (another commit's src/) first on PYTHONPATH")
    ap.add_argument("--fresh", action="store_true", help="each timed run in a new empty folder with a new MLflow store (a first-time user), not one shared store")
    ap.add_argument("--update-docs", action="store_true", help="put the table into docs/benchmarks.md's Start-up section")
    ap.add_argument("--provisional", action="store_true", help="mark the docs block provisional (a busy machine)")
    ap.add_argument("--log", type=Path, help="every command's output (default: beside --out, else a temp file)")
    a = ap.parse_args(argv)

    info = machine()
    cuda = info["gpu"] != "-" and not a.no_cuda
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    with tempfile.TemporaryDirectory(prefix="mpsrun-wall-") as d:
        work = Path(d)
        notes: list[str] = []
        root = None
        if cuda:
            root, how = fashion_root(a.fashion_root, work)
            notes.append(f"fashion data: {how}")
        if a.fresh:
            notes.append("each timed run in a new empty folder that creates its own MLflow store (a first-time user)")
        cmds = commands(cuda, a.helpers, root, a.export_end, a.baseline_src.resolve() if a.baseline_src else None)
        if a.cuda_only:
            cmds = [c for c in cmds if c.key in ("floor_cuda", "fashion", "fashion_end", "fashion_base")]
        log_path = a.log or (a.out.with_suffix(".log") if a.out else work / "wall.log")
        with open(log_path, "w") as log:
            print(f"warm-up round (creates the MLflow store, fills OS caches); log: {log_path}", file=sys.stderr)
            for c in cmds:
                timed(c, work, log)
            for i in range(a.repeats):
                order = cmds if i % 2 == 0 else list(reversed(cmds))  # alternate, so drift hits all alike
                for c in order:
                    cwd = work
                    if a.fresh:
                        cwd = Path(tempfile.mkdtemp(prefix="round-", dir=work))
                    w = timed(c, cwd, log)
                    if w is None:
                        c.failures += 1
                    else:
                        c.times.append(w)
                print(f"round {i + 1}/{a.repeats}: " + "  ".join(f"{c.key} {c.times[-1]:.2f}" for c in cmds if c.times), file=sys.stderr)
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    block = table(cmds, info, a.repeats, notes, (load0, load1))
    print(block)
    if a.out:
        a.out.write_text(block)
    if a.update_docs:
        update_docs(block, a.provisional)
    return 0 if all(c.times for c in cmds) else 1


if __name__ == "__main__":
    raise SystemExit(main())
