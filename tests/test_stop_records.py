"""What the screen showed is in MLflow: SIGTERM in the instant after an epoch's line was printed.

The test reads the child's stdout and sends SIGTERM the moment an epoch line appears,
then checks that epoch's metrics and its checkpoint are in the store of the KILLED run.
Repeated (a fresh run, then two resumes of it, each stopped at the first line it prints),
because a race lost one time in two is still lost. The model is wide enough (a few MB of
weights and Adam state to copy) that an epoch's records take a moment to hand over: before
the line waited for them, half the stops lost the epoch the screen had just shown.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from typing import Any

from tests.test_checkpoint import MPSRUN, _env

RECIPE = """\
device: cpu
epochs: 4
batch_size: 128
seed: 1
dataset: {name: digits}
model: {name: mlp, hidden: [1024, 1024]}
optimizer: {name: adam, lr: 0.001}
tracking: {experiment: shown, log_model: false, figures: false}
"""

LINE = re.compile(r"^epoch (\d+)/4\b")


def _stop_at_first_line(work: Any, *args: str) -> tuple[int, str]:
    """Start `mpsrun ARGS`; SIGTERM at once when the first epoch line shows; (that epoch 0-based, all output)."""
    proc = subprocess.Popen([MPSRUN, *args], cwd=work.path, env=_env(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    seen: list[str] = []
    shown = None
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        seen.append(line)
        m = LINE.match(line)
        if m:
            os.kill(proc.pid, signal.SIGTERM)  # the instant the user saw it
            shown = int(m.group(1)) - 1
            break
        assert time.monotonic() < deadline, "".join(seen)
    rest, _ = proc.communicate(timeout=120)
    out = "".join(seen) + rest
    assert shown is not None, out
    assert proc.returncode == 143, out
    return shown, out


def test_an_epoch_shown_before_sigterm_is_in_mlflow_with_its_checkpoint(work: Any) -> None:
    work.write("w.yaml", RECIPE)
    run_id = None
    for attempt in range(3):  # a fresh run, then two resumes of it: each stopped right after its first line
        shown, out = _stop_at_first_line(work, "run", "w.yaml", "-q") if run_id is None else _stop_at_first_line(work, "resume", run_id, "-q")
        if run_id is None:
            (run,) = work.runs("shown")
            run_id = run.info.run_id
        run = work.client().get_run(run_id)
        assert run.info.status == "KILLED", out
        steps = sorted(s for s, _ in work.history(run_id, "val_loss"))
        assert shown in steps, f"attempt {attempt}: epoch {shown + 1} was on the screen but not in MLflow ({steps})\n{out}"
        assert int(run.data.tags.get("mpsrun.checkpoint.epoch", -1)) >= shown, (attempt, run.data.tags["mpsrun.interrupted"], out)
        said = re.search(r"last checkpoint: epoch (\d+)", run.data.tags["mpsrun.interrupted"])  # the tag agrees with the screen
        assert said and int(said.group(1)) >= shown, run.data.tags["mpsrun.interrupted"]
        assert steps == list(range(len(steps))), steps  # each epoch once
    assert len(steps) >= 3  # three stops, each after a new epoch
