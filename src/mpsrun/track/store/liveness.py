"""Is the process behind a RUNNING run still alive? Tags that answer it, across machines.

A run killed by SIGKILL (or a lost machine) stays RUNNING in MLflow forever. Each
run therefore records who runs it (`mpsrun.host`, `mpsrun.pid`, `mpsrun.pid_start`:
the process start time from psutil, so a recycled pid is not mistaken for the
run) and a heartbeat (`mpsrun.heartbeat`, seconds since the epoch) refreshed by a
thread every HEARTBEAT_S. On the same host the process table answers; from
another host only the heartbeat can, and a heartbeat older than STALE_S means gone.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil

HEARTBEAT_S = 30.0
STALE_S = 120.0  # four missed heartbeats
HOST, PID, PID_START, HEARTBEAT = "mpsrun.host", "mpsrun.pid", "mpsrun.pid_start", "mpsrun.heartbeat"


def identity() -> dict[str, str]:
    """This process, as tags."""
    me = psutil.Process()
    return {
        HOST: socket.gethostname(),
        PID: str(me.pid),
        PID_START: f"{me.create_time():.3f}",
        HEARTBEAT: f"{time.time():.3f}",
    }


@dataclass
class Verdict:
    state: str  # "alive", "gone" or "unknown" (a run without liveness tags)
    reason: str

    @property
    def gone(self) -> bool:
        return self.state == "gone"


def check(tags: dict[str, str], now: float | None = None, host: str | None = None) -> Verdict:
    """Whether the process that owns a RUNNING run is alive, and how we know."""
    now = time.time() if now is None else now
    host = socket.gethostname() if host is None else host
    if PID not in tags or HOST not in tags:
        return Verdict("unknown", "no liveness tags (run not started by this mpsrun)")
    beat = _float(tags.get(HEARTBEAT))
    age = f"last heartbeat {now - beat:.0f} s ago" if beat is not None else "no heartbeat"
    if tags[HOST] != host:
        if beat is not None and now - beat <= STALE_S:
            return Verdict("alive", f"on host {tags[HOST]}, {age}")
        return Verdict("gone", f"on host {tags[HOST]}, {age} (stale after {STALE_S:.0f} s)")
    pid, started = int(tags[PID]), _float(tags.get(PID_START))
    try:
        proc = psutil.Process(pid)
        if started is not None and abs(proc.create_time() - started) > 1.0:
            return Verdict("gone", f"pid {pid} on {host} is now another process ({age})")
        if proc.status() == psutil.STATUS_ZOMBIE:
            return Verdict("gone", f"pid {pid} on {host} has exited ({age})")
        return Verdict("alive", f"pid {pid} on {host} is running")
    except psutil.NoSuchProcess:
        return Verdict("gone", f"pid {pid} on {host} has exited ({age})")
    except psutil.Error as e:  # access denied: it exists
        return Verdict("alive", f"pid {pid} on {host} exists ({type(e).__name__})")


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


class Heartbeat:
    """Refreshes `mpsrun.heartbeat` on a run every `interval` seconds, from a daemon thread."""

    def __init__(self, client: Any, run_id: str, interval: float = HEARTBEAT_S) -> None:
        self.client = client
        self.run_id = run_id
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="mpsrun-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _work(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.client.set_tag(self.run_id, HEARTBEAT, f"{time.time():.3f}")
            except Exception:  # noqa: BLE001 - a busy store: the next beat tries again
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
