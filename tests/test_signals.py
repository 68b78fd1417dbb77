"""SIGTERM and SIGINT on a real `mpsrun run` process: checkpoint, flush, KILLED, exit 143 / 130, resumable.

SIGTERM is what Slurm preemption, `docker stop` and Kubernetes send. Before this,
the process died at once, the run stayed RUNNING and buffered metrics were lost.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from tests.test_checkpoint import SLOW, cli_proc, start, wait_for_checkpoint


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_mid_epoch_checkpoints_flushes_and_marks_killed(work: Any, sig: int, code: int) -> None:
    work.write("slow.yaml", SLOW)
    proc = start(work, "run", "slow.yaml", "-q")
    run_id = wait_for_checkpoint(work, "slow", 0, proc)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, out
    assert f"interrupted ({signal.Signals(sig).name})" in out
    run = work.client().get_run(run_id)
    assert run.info.status == "KILLED"
    tag = run.data.tags["mpsrun.interrupted"]  # "during epoch N", or "after epoch N ... ended" when it fell between two
    assert tag.startswith(f"{signal.Signals(sig).name} during epoch") or tag.startswith(f"{signal.Signals(sig).name} after epoch"), tag
    steps = [s for s, _ in work.history(run_id, "val_loss")]
    assert steps and steps == list(range(len(steps)))  # every finished epoch's metrics are in the store
    done = int(run.data.tags["mpsrun.checkpoint.epoch"])
    assert steps[-1] == done  # the last finished epoch has its checkpoint

    if sig == signal.SIGTERM:  # and it goes on in the same run, each epoch once
        r = cli_proc(work, "resume", run_id, "-q")
        assert r.returncode == 0, r.stdout + r.stderr
        assert work.client().get_run(run_id).info.status == "FINISHED"
        assert [s for s, _ in work.history(run_id, "val_loss")] == [0, 1, 2]
