"""One owner per run: two `mpsrun resume` of one run started together, on the SQLite store and
through a real `mlflow server`; a stale owner taken over; a live one on another host named.

The race is real: two console-script processes started at the same instant, each planning,
building and claiming on its own. Before owners, both trained: 77 val_loss points for 40
epochs. Now exactly one trains; the other exits 2 within seconds, naming the owner.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest

from tests.proc_helpers import MlflowServer
from tests.test_checkpoint import DIGITS, MPSRUN, _env

OWNER_PARAM = "mpsrun.owner."


@pytest.fixture
def server(mlflow_server: MlflowServer) -> MlflowServer:
    """The session's `mlflow server` (tests/conftest.py): these tests only write their own runs to it."""
    return mlflow_server


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _race(work: Any, run_id: str, uri_args: list[str]) -> list[tuple[int, str, float]]:
    """Two `mpsrun resume RUN epochs=4` started together; (exit code, output, seconds) of each."""
    cmd = [MPSRUN, "resume", run_id, "epochs=4", "-q", "tracking.log_model=false", *uri_args]  # no model: a shorter race
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, cwd=work.path, env=_env(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    ended: dict[int, float] = {}
    while len(ended) < 2 and time.monotonic() - t0 < 300:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic() - t0
        time.sleep(0.05)
    return [(p.returncode, p.communicate(timeout=30)[0], ended.get(i, 1e9)) for i, p in enumerate(procs)]


def _check_one_owner(c: Any, run_id: str, results: list[tuple[int, str, float]]) -> None:
    codes = sorted(r[0] for r in results)
    assert codes == [0, 2], results
    (won,) = [r for r in results if r[0] == 0]
    (lost,) = [r for r in results if r[0] == 2]
    run = c.get_run(run_id)
    claims = {k: json.loads(v) for k, v in run.data.params.items() if k.startswith(OWNER_PARAM)}
    assert sorted(claims) == ["mpsrun.owner.0", "mpsrun.owner.1"], claims  # one claim per run start, the race's single winner
    winner = claims["mpsrun.owner.1"]
    text = " ".join(lost[1].split())
    assert f"pid {winner['pid']} on host {winner['host']}, since " in text, text  # the owner named: host, pid, since when
    assert "Traceback" not in lost[1]
    assert lost[2] < won[2] + 3  # it gave way while the owner was at work (or as it ended), not after a run of its own
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in c.get_metric_history(run_id, "val_loss"))
    assert steps == [0, 1, 2, 3], steps  # each epoch logged once: only the owner wrote epochs
    assert run.data.tags["mpsrun.owner.released"] == "1"
    assert run.data.tags["mpsrun.resumed"] == "1"


def test_two_resumes_racing_on_the_sqlite_store(work: Any) -> None:
    work.write("q.yaml", DIGITS)
    r = work.cli("run", "q.yaml", "epochs=2", "-q")
    assert r.exit_code == 0, r.output
    (run,) = work.runs("quick")
    _check_one_owner(work.client(), run.info.run_id, _race(work, run.info.run_id, []))


def test_two_resumes_racing_through_a_tracking_server(work: Any, server: MlflowServer) -> None:
    work.write("q.yaml", DIGITS.replace("experiment: quick", "experiment: owner-race"))
    r = work.cli("run", "q.yaml", "epochs=2", "-q", "--tracking-uri", server.uri)
    assert r.exit_code == 0, r.output
    c = _client(server.uri)
    (run,) = c.search_runs([c.get_experiment_by_name("owner-race").experiment_id])
    _check_one_owner(c, run.info.run_id, _race(work, run.info.run_id, ["--tracking-uri", server.uri]))
    names = sorted(a.path for a in c.list_artifacts(run.info.run_id, "checkpoints"))
    assert names == ["checkpoints/best.pt", "checkpoints/last.pt", "checkpoints/prev.pt"]  # prev uploaded where the store cannot rename


def test_a_param_claim_is_taken_once_on_both_stores(work: Any, server: MlflowServer) -> None:
    """The primitive the lease rests on: a second value for a logged param is refused, on SQLite and over REST."""
    from mlflow.exceptions import MlflowException

    for uri in (work.uri, server.uri):
        c = _client(uri)
        exp = c.create_experiment(f"claims-{len(uri)}")
        rid = c.create_run(exp).info.run_id
        c.log_param(rid, "mpsrun.owner.1", "a")
        c.log_param(rid, "mpsrun.owner.1", "a")  # the same claim again: idempotent
        with pytest.raises(MlflowException):
            c.log_param(rid, "mpsrun.owner.1", "b")
        assert c.get_run(rid).data.params["mpsrun.owner.1"] == "a"


def _forge_owner(work: Any, run_id: str, generation: int, since: float, beat: float) -> None:
    """A claim by a process on another host, with its heartbeat, on a run left RUNNING (as a lost machine leaves it)."""
    c = work.client()
    value = json.dumps({"host": "elsewhere", "pid": 4242, "pid_start": 1.0, "since": since, "token": "forged"})
    c.log_param(run_id, f"{OWNER_PARAM}{generation}", value)
    c.set_tag(run_id, "mpsrun.heartbeat", f"{beat:.3f}")
    c.set_tag(run_id, "mpsrun.host", "elsewhere")
    c.set_tag(run_id, "mpsrun.pid", "4242")
    c.update_run(run_id, status="RUNNING")


def test_a_live_owner_elsewhere_is_named_and_a_stale_one_taken_over(work: Any) -> None:
    work.write("q.yaml", DIGITS)
    assert work.cli("run", "q.yaml", "epochs=2", "-q").exit_code == 0
    (run,) = work.runs("quick")
    rid = run.info.run_id
    now = time.time()
    _forge_owner(work, rid, 1, since=now - 1000, beat=now - 5)  # another machine has trained it a while, and beats
    t = time.monotonic()
    r = work.cli("resume", rid, "epochs=4")
    assert r.exit_code == 2, r.output
    text = " ".join(r.stderr.split())
    assert "owned by pid 4242 on host elsewhere, since" in text and "last heartbeat" in text, text
    assert time.monotonic() - t < 15
    assert [s for s, _ in work.history(rid, "val_loss")] == [0, 1]  # nothing written

    work.client().set_tag(rid, "mpsrun.heartbeat", f"{now - 1000:.3f}")  # that machine went silent long ago
    r = work.cli("resume", rid, "epochs=4", "-q")
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "took over run" in out and "pid 4242 on host elsewhere" in out, out  # said on screen
    done = work.client().get_run(rid)
    assert "pid 4242 on host elsewhere" in done.data.tags["mpsrun.owner.takeover.2"]  # and tagged
    assert done.data.tags["mpsrun.owner"].startswith("pid ") and "(claim 2)" in done.data.tags["mpsrun.owner"]
    assert sorted(s for s, _ in work.history(rid, "val_loss")) == [0, 1, 2, 3]


def test_owner_verdicts() -> None:
    """Released only once the run is no longer RUNNING; this live process is alive; a gone pid, a stale host are not."""
    import psutil

    from mpsrun.track.store import owner

    mine = owner.me(3)
    back = owner.Claim.parse(3, mine.value())
    assert back is not None and (back.host, back.pid, back.token) == (mine.host, mine.pid, mine.token) and abs(back.since - mine.since) < 0.01
    assert owner.verdict(mine, {}).state == "alive"
    assert owner.verdict(mine, {owner.RELEASED: "3"}, "RUNNING").state == "alive"  # let go, but its status not yet set
    assert owner.verdict(mine, {owner.RELEASED: "3"}, "KILLED").state == "released"
    assert owner.verdict(mine, {owner.RELEASED: "2"}, "KILLED").state == "alive"  # a former owner's release is not this one's
    dead = psutil.Popen(["true"])
    dead.wait()
    assert owner.verdict(owner.Claim(3, mine.host, dead.pid, None, time.time(), "x"), {}).gone
    far = owner.Claim(3, "elsewhere", 1, 1.0, time.time() - 1000, "x")
    assert owner.verdict(far, {"mpsrun.heartbeat": f"{time.time() - 10:.3f}"}).state == "alive"
    assert owner.verdict(far, {"mpsrun.heartbeat": f"{time.time() - 1000:.3f}"}).gone
    assert owner.latest({"mpsrun.owner.0": mine.value(), "mpsrun.owner.10": far.value(), "mpsrun.owner.2": mine.value(), "x": "1"}).host == "elsewhere"


def test_a_sweep_parent_has_one_owner_a_second_driver_joins_as_workers_and_the_last_out_publishes(work: Any) -> None:
    """A sweep's parent is claimed like any run. While a live process holds it, `mpsrun resume PARENT` adds a
    trial under it (workers may join a study) but neither re-marks the parent (status, pid) nor publishes on it;
    once the holder is gone, the next command takes the parent over, publishes both trials and closes it."""
    import socket
    import sys

    import psutil

    from mpsrun.track.store import owner
    from tests.test_sweep import children, recipe

    path = recipe(work, "own.yaml", "sw_own", "optimizer.lr: {low: 0.01, high: 0.2}", trials=1)
    assert work.cli("sweep", str(path), "-q").exit_code == 0
    (parent,), _ = children(work, "sw_own")
    rid, c = parent.info.run_id, work.client()
    assert owner.latest(parent.data.params) is not None  # the sweep's own claim, released when it ended
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:  # another live driver on this host holds the parent (claim 1, as its `mpsrun sweep` would log it)
        held = owner.Claim(1, socket.gethostname(), holder.pid, psutil.Process(holder.pid).create_time(), time.time(), "other")
        c.log_param(rid, held.key, held.value())
        c.update_run(rid, status="RUNNING")
        pid_before = c.get_run(rid).data.tags["mpsrun.pid"]
        r = work.cli("resume", rid, "sweep.trials=2")
        assert r.exit_code == 0, r.output
        assert f"owned by pid {holder.pid}" in r.output and "joining as extra workers" in r.output
        run = c.get_run(rid)
        assert run.info.status == "RUNNING" and run.data.tags["mpsrun.pid"] == pid_before  # left to its owner
        assert run.data.metrics["trials_complete"] == 1  # not published by the guest
        parents, kids = children(work, "sw_own")
        assert len(parents) == 1 and len(kids) == 2 and {k.data.tags["mlflow.parentRunId"] for k in kids} == {rid}
    finally:
        holder.kill()
        holder.wait()
    r = work.cli("resume", rid, "sweep.trials=2")  # the holder is gone without letting go: taken over
    assert r.exit_code == 0, r.output
    assert "took over" in r.output, r.output
    run = c.get_run(rid)
    assert run.info.status == "FINISHED" and run.data.metrics["trials_complete"] == 2
    assert owner.latest(run.data.params).generation == 2 and run.data.tags[owner.RELEASED] == "2"
