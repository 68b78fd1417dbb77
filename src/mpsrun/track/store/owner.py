"""One owner per run: only one process writes a run's epochs at a time, on any store.

MLflow has no compare-and-set, but a param can be logged only once: logging the same
key again with another value fails, in one database transaction, on the SQLite store
and through a tracking server alike (its primary key is (run, key)). So a process
that wants to write a run's epochs logs the param `mpsrun.owner.<N>` (N: one past the
newest claim on the run; the run's start claims 0) with a value only it can have (its
host, pid, process start time, the time and a random token). Of two processes that
claim the same N at once, exactly one write lands; the other reads the winner back
and gives way, naming it. No shared folder or lock server is assumed.

The owner says it has let go with the tag `mpsrun.owner.released` = N when its run
ends (FINISHED, FAILED or KILLED). An owner that never said so (SIGKILL, a lost
machine) is judged like any RUNNING run (track/store/liveness.py): on the same host its
process is looked up, from another host its heartbeat (or its claim, when newer) must
be younger than STALE_S. A stale owner is taken over: the next claim says so on
screen and in the tag `mpsrun.owner.takeover.<N>`.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from mpsrun.track.store import liveness

PREFIX = "mpsrun.owner."  # params: mpsrun.owner.0, mpsrun.owner.1, ...
RELEASED = "mpsrun.owner.released"  # tag: the generation that let go
OWNER_TAG = "mpsrun.owner"  # tag: who owns the run now, in words
TAKEOVER = "mpsrun.owner.takeover."  # tag per generation that took over a stale owner


@dataclass
class Claim:
    """One process's claim on a run: generation N, who, since when."""

    generation: int
    host: str
    pid: int
    pid_start: float | None
    since: float  # seconds since the epoch
    token: str

    @property
    def key(self) -> str:
        return f"{PREFIX}{self.generation}"

    def value(self) -> str:
        return json.dumps({"host": self.host, "pid": self.pid, "pid_start": self.pid_start, "since": round(self.since, 3), "token": self.token},
                          separators=(",", ":"))

    @classmethod
    def parse(cls, generation: int, value: str) -> "Claim | None":
        try:
            d = json.loads(value)
            return cls(generation, str(d["host"]), int(d["pid"]), d.get("pid_start"), float(d["since"]), str(d.get("token", "")))
        except (ValueError, KeyError, TypeError):
            return None

    def who(self) -> str:
        return f"pid {self.pid} on host {self.host}, since {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(self.since))}"

    def at(self, generation: int) -> "Claim":
        return Claim(generation, self.host, self.pid, self.pid_start, time.time(), secrets.token_hex(6))


def me(generation: int = 0) -> Claim:
    """A claim by this process (call it in the training process, not the MLflow helper)."""
    ident = liveness.identity()
    return Claim(generation, socket.gethostname(), int(ident[liveness.PID]), float(ident[liveness.PID_START]), time.time(), secrets.token_hex(6))


def claims(params: dict[str, str]) -> dict[int, Claim]:
    out: dict[int, Claim] = {}
    for k, v in params.items():
        n = k.removeprefix(PREFIX)
        if k.startswith(PREFIX) and n.isdigit():
            c = Claim.parse(int(n), v)
            if c is not None:
                out[c.generation] = c
    return out


def latest(params: dict[str, str]) -> Claim | None:
    found = claims(params)
    return found[max(found)] if found else None


def verdict(claim: Claim, tags: dict[str, str], status: str = "RUNNING", now: float | None = None) -> liveness.Verdict:
    """'released' (it let go and its run is no longer RUNNING), 'alive' or 'gone' (its process ended, or its heartbeat is stale)."""
    if tags.get(RELEASED) == str(claim.generation) and status != "RUNNING":
        return liveness.Verdict("released", "it let go of the run when it ended")
    beat = claim.since
    try:
        beat = max(beat, float(tags.get(liveness.HEARTBEAT, "")))  # a heartbeat older than the claim is a former owner's
    except ValueError:
        pass
    return liveness.check(
        {liveness.HOST: claim.host, liveness.PID: str(claim.pid), liveness.HEARTBEAT: f"{beat:.3f}",
         **({liveness.PID_START: str(claim.pid_start)} if claim.pid_start is not None else {})},
        now=now,
    )


def owned_by(run_id: str, claim: Claim, v: liveness.Verdict) -> str:
    """The refusal a second writer gets while the owner lives."""
    return (f"run {run_id} is owned by {claim.who()} ({v.reason}); only one process may train a run at a time: "
            "stop that one first (Ctrl-C or SIGTERM checkpoints it) or wait for it to end")


def try_claim(c: Any, run_id: str, base: int | None, mine: Claim) -> dict[str, Any]:
    """Claim the run for `mine`'s process with an MLflow client `c`; plain data back (it may cross a pipe).

    `base`: the newest generation the caller saw when it planned (its checkpoint is from
    then); a claim made since means someone else went on with the run, and this caller's
    plan is stale even when that owner has finished. None: no plan to keep (a fresh claim).
    Returns {"ok": True, "generation", "took_over": text or None} or {"ok": False, "message"}.
    """
    from mlflow.exceptions import MlflowException

    run = c.get_run(run_id)
    top = latest(run.data.params)
    seen = top.generation if top is not None else -1
    v = verdict(top, run.data.tags, run.info.status) if top is not None else None
    if top is not None and v is not None and v.state == "alive":
        return {"ok": False, "message": owned_by(run_id, top, v)}
    if base is not None and seen != base:
        assert top is not None
        return {"ok": False, "message": f"run {run_id} was taken by {top.who()} while this process was starting ({v.reason if v else ''}); "
                                        "run `mpsrun resume` again to go on from where it stands now"}
    claim = mine.at(seen + 1)
    try:
        c.log_param(run_id, claim.key, claim.value())
    except MlflowException:  # "Changing param values is not allowed": another process's claim landed first
        again = claims(c.get_run(run_id).data.params).get(claim.generation)
        if again is None or again.token == claim.token:
            raise
        w = verdict(again, {})
        return {"ok": False, "message": owned_by(run_id, again, w) if w.state == "alive" else
                f"run {run_id} was taken by {again.who()} at the same moment; run `mpsrun resume` again to go on from where it stands now"}
    took = None
    if top is not None and v is not None and v.state == "gone":
        took = f"took over run {run_id} from {top.who()}, which never let go and is gone ({v.reason})"
    return {"ok": True, "generation": claim.generation, "took_over": took, "owner": claim.who()}


def tags_for(claim_generation: int, who: str, took_over: str | None) -> dict[str, str]:
    """What the owner says on the run when it begins."""
    tags = {OWNER_TAG: f"{who} (claim {claim_generation})"}
    if took_over:
        tags[f"{TAKEOVER}{claim_generation}"] = took_over
    return tags
