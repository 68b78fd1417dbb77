"""A helper process that hangs (track/helper/pipe.py): the training process stops waiting and goes on.

The MLflow helper is a real process and SIGSTOP a real signal: a stopped helper answers
nothing and beats no more. Once its heartbeat has stood still for MPSRUN_HELPER_STALL_S,
the training process kills it, opens the store itself, writes every metric again and
finishes the run. A helper that is only slow (importing mlflow at start, seconds longer
than the stall window here) keeps beating and is waited for.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest


def test_a_hung_helper_is_killed_and_the_run_goes_on_but_a_busy_one_is_waited_for(work, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from mpsrun.track.helper import background

    monkeypatch.setenv("MPSRUN_HELPER_STALL_S", "1")
    t = background.start(work.uri, "stall", mode="process")
    info = t.start("r", {"x": "1"})  # waits for the helper to import mlflow and open the store: seconds, beating
    assert t._remote is not None and t._remote.proc.poll() is None  # busy was not taken for hung
    t.log_metrics({"loss": 1.0}, step=0)
    t.log_metrics({"loss": 0.5}, step=1)
    t.flush()
    pid = t._remote.proc.pid
    os.kill(pid, signal.SIGSTOP)  # hung: alive, silent
    try:
        t.log_metrics({"loss": 0.25}, step=2)  # posted: does not wait
        t0 = time.monotonic()

        def finish() -> None:
            t.set_tags({"after": "yes"})
            t.finish("FINISHED")  # waits: finds the heartbeat stopped, kills the helper, takes over

        th = threading.Thread(target=finish, daemon=True)  # a regression hangs here: fail, do not hang the suite
        th.start()
        th.join(60)
        assert not th.is_alive(), "the training process still waits for a stopped helper"
        waited = time.monotonic() - t0
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert waited < 30
    assert t._remote is None
    c = work.client()
    run = c.get_run(info.run_id)
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in c.get_metric_history(info.run_id, "loss")] == [(0, 1.0), (1, 0.5), (2, 0.25)]
    assert run.data.tags["after"] == "yes" and run.data.tags["x"] == "1"
    assert "stopped answering" in run.data.tags["mpsrun.mlflow_helper"]
