"""How long `mpsrun ui` takes to answer, and what it prints meanwhile.

Each repeat copies a small SQLite store (one experiment, one run) into a fresh folder, starts
`mpsrun ui --port P` there as a user would (no flags: ./mlruns), and measures from the start to
(a) the first 200 of the UI's page `/` (polled every 50 ms) and (b) the `MLflow UI: ` line on its
stdout; then SIGTERM, as `docker stop` sends. Medians of N repeats; with `--compare SRC` the
repeats alternate between this checkout and another tree's `src` (e.g. an older commit's
`git archive` unpacked), so both see the same machine load.

    python benchmarks/ui_start.py --repeats 5
    python benchmarks/ui_start.py --repeats 5 --compare /tmp/old/src

Written for issue 42 item 4 (27 s to answer on the 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def _store(folder: Path) -> Path:
    from mlflow.tracking import MlflowClient

    db = folder / "template.db"
    c = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run = c.create_run(c.create_experiment("demo"))
    c.log_metric(run.info.run_id, "val_loss", 0.5)
    c.set_terminated(run.info.run_id)
    return db


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def once(template: Path, folder: Path, src: str | None) -> tuple[float, float | None, list[str]]:
    """(seconds to the page's first 200, seconds to the URL line, the lines printed)."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "mlruns").mkdir(parents=True)
    shutil.copy(template, folder / "mlruns" / "mlflow.db")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    if src:
        env["PYTHONPATH"] = src
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "mpsrun", "ui", "--port", str(port)], cwd=folder, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            lines.append((time.monotonic() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    answered = float("nan")
    while time.monotonic() - t0 < 180:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                if r.status == 200:
                    answered = time.monotonic() - t0
                    break
        except OSError:
            time.sleep(0.05)
    end = time.monotonic() + 10
    while not any("MLflow UI: " in ln for _, ln in lines) and time.monotonic() < end:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(60)
    reader.join(5)
    url = next((t for t, ln in lines if "MLflow UI: " in ln), None)
    return answered, url, [ln for _, ln in lines]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compare", help="another tree's src folder, measured alternately as 'other'")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        template = _store(Path(d))
        kinds = [("this", None)] + ([("other", args.compare)] if args.compare else [])
        got: dict[str, list[tuple[float, float | None]]] = {k: [] for k, _ in kinds}
        for i in range(args.repeats):
            for kind, src in kinds:
                answered, url, lines = once(template, Path(d) / f"{kind}{i}", src)
                got[kind].append((answered, url))
                print(f"{kind} #{i + 1}: page answered {answered:.2f} s, URL line at {url if url is None else f'{url:.2f} s'}, "
                      f"{len(lines)} line(s) on screen", flush=True)
                if i == 0:
                    for ln in lines:
                        print(f"    | {ln[:160]}")
        for kind, _ in kinds:
            a = [x for x, _ in got[kind]]
            u = [x for _, x in got[kind] if x is not None]
            print(f"{kind}: median page answer {statistics.median(a):.2f} s (min {min(a):.2f}, max {max(a):.2f}); "
                  f"median URL line {statistics.median(u):.2f} s" if u else f"{kind}: median page answer {statistics.median(a):.2f} s; no URL line")


if __name__ == "__main__":
    main()
