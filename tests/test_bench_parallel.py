"""`mpsrun bench --parallel N`: cells at once, each its own process, each a child run of one parent.

Real processes, real training, one real SQLite store written by several processes.
"""

from __future__ import annotations

import time

from mpsrun.bench import parallel

GRID = """\
device: cpu
epochs: 1
batch_size: 32
seed: 0
dataset: {{name: digits}}
model: {{name: {model}}}
optimizer: {{name: sgd, lr: 0.05}}
matrix:
  optimizer.lr: [0.05, 0.1, 0.2]
tracking: {{experiment: par, log_model: false}}
"""

SLOW = """\
import os
import time
from pathlib import Path

from torch import nn


class Slow(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.lin = nn.Linear(64, num_classes)
        self.waited = False

    def forward(self, x):
        if not self.waited:  # once per process: until a second cell is here too (at most 60 s), so cells that run
            # side by side overlap whatever the machine's load (a 2 s sleep did not on the GPU gate's busy machine)
            here = Path(os.environ["SLOW_BARRIER"])
            (here / str(os.getpid())).touch()
            end = time.monotonic() + 60
            while len(list(here.iterdir())) < 2 and time.monotonic() < end:
                time.sleep(0.05)
            self.waited = True
        return self.lin(x.flatten(1))


def slow(num_classes: int) -> nn.Module:
    return Slow(num_classes)
"""


def test_cells_run_side_by_side_as_child_runs(work, fake_dist, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    site = fake_dist("slow-plugin", SLOW, models={"slow": "slow"})
    monkeypatch.setenv("PYTHONPATH", str(site))  # the cell processes find the plugin as an installed package
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (work.path / "barrier").mkdir()
    monkeypatch.setenv("SLOW_BARRIER", str(work.path / "barrier"))
    r = work.write("g.yaml", GRID.format(model="slow"))
    res = work.cli("bench", str(r), "--parallel", "2", helper=None)  # cell processes: the default helper
    assert res.exit_code == 0, res.output
    assert "share this machine's" in res.stdout
    runs = work.runs("par")
    parents = [x for x in runs if x.data.tags.get("mpsrun.bench") == "parent"]
    children = [x for x in runs if x.data.tags.get("mpsrun.bench") == "child"]
    assert len(parents) == 1 and len(children) == 3
    assert parents[0].data.tags["bench.parallel"] == "2"
    assert {c.data.tags["bench.parent"] for c in children} == {parents[0].info.run_id}
    assert all(c.info.status == "FINISHED" for c in children)
    assert sorted(c.data.params["optimizer.lr"] for c in children) == ["0.05", "0.1", "0.2"]
    # at most two at once, and two did overlap: the first two started before either ended
    spans = sorted((c.info.start_time, c.info.end_time) for c in children)
    assert spans[1][0] < spans[0][1]
    assert max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans) <= 2  # never more than --parallel
    assert parents[0].info.run_id in res.stdout


def test_slots_on_a_cpu_machine(work) -> None:  # type: ignore[no-untyped-def]
    from mpsrun.plugins import resolve
    from mpsrun.recipe.matrix import expand

    r = work.write("g.yaml", GRID.format(model="mlp"))
    cells = expand(resolve(r, []))
    s, notes = parallel.slots(3, cells)
    assert [x.gpu for x in s] == [None, None, None]
    assert "share" in notes[0]
    env = parallel._env(s[0], 2)
    assert "CUDA_VISIBLE_DEVICES" not in env or env["CUDA_VISIBLE_DEVICES"] == __import__("os").environ.get("CUDA_VISIBLE_DEVICES")


def test_a_crashing_cell_process_is_a_failed_cell(work, tmp_path) -> None:  # type: ignore[no-untyped-def]
    err = tmp_path / "e.err"
    err.write_text("Traceback ...\nMemoryError: killed\n")
    ok, message = parallel._outcome(-9, tmp_path / "missing.json", err)
    assert not ok and "code -9" in message and "MemoryError" in message
