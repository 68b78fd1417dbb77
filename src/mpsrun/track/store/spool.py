"""The offline spool: writes the store refused, kept on local disk and replayed in order.

Why. Training should not stop, or lose a single metric, because the tracking server
went away for a while (restarted, a network blip, a laptop lid closed over an SSH
tunnel). When a write fails because the store cannot be reached, the tracker
appends it to an append-only JSON-lines file, one operation per line, and from
then on appends every later write there too, so their order is kept. Every few
seconds (and at the end of the run) it tries to replay the file; when the server
answers again, the lines go in, in order, and the file is removed. A run that
ends while the server is still away leaves its file for `mpsrun sync`.

Where. Beside an embedded SQLite store (`<store>/spool/`), else under the user's
cache (`$XDG_CACHE_HOME` or `~/.cache`, `mpsrun/spool/<uri>/`), one file per run:
`<run_id>.jsonl`, with copies of artifact files in `<run_id>.files/`.

Operations: `batch` (metrics, params, tags), `text` (a text artifact), `artifact`
(a file copied into the spool), `terminate` (the run's final status and end time).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from mpsrun.track.store.lock import is_locked_error, sqlite_path


def spool_dir(uri: str) -> Path:
    """Where spool files of the store at `uri` live."""
    db = sqlite_path(uri)
    if db is not None:
        return db.resolve().parent / "spool"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", uri).strip("_")[:120] or "default"
    return cache / "mpsrun" / "spool" / slug


@dataclass
class ReplayReport:
    run_id: str
    ops: int
    path: Path


class Spool:
    """The spool file of one run: append in order, replay in order, gone when replayed."""

    def __init__(self, uri: str, run_id: str) -> None:
        self.uri = uri
        self.run_id = run_id
        self.path = spool_dir(uri) / f"{run_id}.jsonl"
        self.files = self.path.with_suffix(".files")
        self._lock = threading.Lock()

    # -- writing
    def pending(self) -> bool:
        return self.path.exists() and self.path.stat().st_size > 0

    def count(self) -> int:
        if not self.path.exists():
            return 0
        with self.path.open() as f:
            return sum(1 for line in f if line.strip())

    def append(self, op: dict[str, Any]) -> None:
        """One operation, flushed and fsynced: a crash right after loses nothing spooled before it."""
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(op, allow_nan=True) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def batch(self, metrics: list[Any] = (), params: list[Any] = (), tags: list[Any] = ()) -> None:  # type: ignore[assignment]
        """MLflow Metric / Param / RunTag entities, spooled as one `batch` line."""
        self.append(
            {
                "op": "batch",
                "metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics],
                "params": [[p.key, p.value] for p in params],
                "tags": [[t.key, t.value] for t in tags],
            }
        )

    def text(self, text: str, name: str) -> None:
        self.append({"op": "text", "text": text, "name": name})

    def artifact(self, path: str | Path, folder: str | None) -> None:
        """The file is copied into the spool now: the original may be a temporary file."""
        src = Path(path)
        dest = self.files / uuid.uuid4().hex / src.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dest)
        else:
            shutil.copy2(src, dest)
        self.append({"op": "artifact", "path": str(dest), "folder": folder})

    def terminate(self, status: str) -> None:
        self.append({"op": "terminate", "status": status, "end_time": int(time.time() * 1000)})

    # -- replaying
    def _ops(self) -> list[dict[str, Any]]:
        with self.path.open() as f:
            return [json.loads(line) for line in f if line.strip()]

    def replay(self, c: Any) -> int:
        """Apply every spooled operation in order; the number applied.

        On a failure the operations not yet applied are written back (atomically) and
        the error raised; applied ones are not repeated next time.
        """
        with self._lock:
            if not self.pending():
                return 0
            ops = self._ops()
            done = 0
            try:
                for op in ops:
                    apply(c, self.run_id, op)
                    done += 1
            except BaseException:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text("".join(json.dumps(o, allow_nan=True) + "\n" for o in ops[done:]))
                os.replace(tmp, self.path)
                raise
            self.path.unlink()
            shutil.rmtree(self.files, ignore_errors=True)
            return done


def apply(c: Any, run_id: str, op: dict[str, Any]) -> None:
    """One spooled operation against an MLflow client."""
    from mlflow.entities import Metric, Param, RunTag

    kind = op["op"]
    if kind == "batch":
        metrics = [Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in op["metrics"]]
        params = [Param(k, v) for k, v in op["params"]]
        tags = [RunTag(k, v) for k, v in op["tags"]]
        for i in range(0, max(len(metrics), 1), 1000):
            c.log_batch(run_id, metrics=metrics[i : i + 1000], params=params if i == 0 else [], tags=tags if i == 0 else [])
    elif kind == "text":
        c.log_text(run_id, op["text"], op["name"])
    elif kind == "artifact":
        c.log_artifact(run_id, op["path"], op.get("folder"))
    elif kind == "terminate":
        c.set_terminated(run_id, op["status"], end_time=op.get("end_time"))
    else:
        raise ValueError(f"unknown spooled operation {kind!r}")


def spooled_runs(uri: str) -> Iterator[Spool]:
    """Every run with a spool file for the store at `uri`, oldest file first."""
    d = spool_dir(uri)
    if not d.is_dir():
        return iter(())
    files = sorted((p for p in d.glob("*.jsonl") if p.stat().st_size > 0), key=lambda p: p.stat().st_mtime)
    return iter([Spool(uri, p.stem) for p in files])


# MLflow error codes that mean "the server answered and the request itself is wrong".
CLIENT_ERRORS = {
    "INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS",
    "INVALID_STATE", "PERMISSION_DENIED", "UNAUTHENTICATED", "ENDPOINT_NOT_FOUND",
}


def _warn(message: str) -> None:
    import sys

    print(f"warning: {message}", file=sys.stderr, flush=True)


class Outbox:
    """Every write of one run goes through here: straight to the store, or, while the store
    is away, to the run's spool (and everything after it too, to keep the order).

    "Away" means an HTTP store failed the write without refusing it (no answer, a
    timeout, a 5xx after MLflow's bounded retries), or SQLite stayed locked past the
    retries; an error that refuses the request itself (a bad value, a rejected
    parameter change: MLflow's client error codes) is the caller's to report, not spooled.
    """

    def __init__(self, uri: str, note: Callable[[str], None] = _warn) -> None:
        self.uri = uri
        self.note = note
        self.spool: Spool | None = None
        self.spooled = 0  # operations sent to the spool during this run
        self.replayed = 0  # of which replayed while the run went on
        self.since: str | None = None  # when the store first went away
        self._io = threading.RLock()

    def bind(self, run_id: str) -> None:
        self.spool = Spool(self.uri, run_id)

    def send(self, write: Callable[[], Any], spool_it: Callable[[Spool], None]) -> None:
        """Write now, or spool; raises only errors that are not the store being away."""
        with self._io:
            sp = self.spool
            if sp is not None and sp.pending():
                spool_it(sp)
                self.spooled += 1
                return
            try:
                write()
            except Exception as e:
                if sp is None or not self._away(e):
                    raise
                self._went_away(e, sp)
                spool_it(sp)
                self.spooled += 1

    def _away(self, e: BaseException) -> bool:
        """Worth spooling: the store is unreachable or failing on its side, not refusing the request."""
        from mpsrun.track.store import remote

        if is_locked_error(e):
            return True
        if not remote.is_http(self.uri):
            return False
        if getattr(e, "error_code", "") in CLIENT_ERRORS:
            return False  # the server answered and refused this write: spooling would not help
        return True  # no answer, a timeout, or a 5xx/429 after MLflow's (bounded) retries

    def _went_away(self, e: BaseException, sp: Spool) -> None:
        if self.since is None:
            self.since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        self.note(
            f"tracking store {self.uri} is not answering ({msg}); training goes on, writes are spooled to "
            f"{sp.path} and replayed when it answers again (or by: mpsrun sync --tracking-uri {self.uri})"
        )

    def try_replay(self, c: Any) -> bool:
        """Replay the spool if there is one; True when nothing is left pending."""
        with self._io:
            sp = self.spool
            if sp is None or not sp.pending():
                return True
            try:
                n = sp.replay(c)
            except Exception:
                return False
            self.replayed += n
            self.note(f"tracking store {self.uri} answers again: {n} spooled writes replayed in order")
            return True

    def pending(self) -> bool:
        return self.spool is not None and self.spool.pending()

    def summary(self) -> str:
        """What happened, for the run's `mpsrun.spool` tag; empty when nothing was spooled."""
        if not self.spooled or self.spool is None:
            return ""
        left = "" if not self.pending() else f"; {self.spool.count()} not yet replayed (mpsrun sync)"
        return (
            f"store unreachable since {self.since}: {self.spooled} writes spooled to {self.spool.path}, "
            f"{self.replayed} replayed during the run{left}"
        )
