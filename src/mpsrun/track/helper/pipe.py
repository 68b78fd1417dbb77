"""The pipe between `mpsrun run` and its MLflow helper process (track/helper/process.py).

Length-prefixed pickles: requests on the helper's stdin, answers on its original stdout,
in order. `_Remote` starts the helper and carries calls; `post` sends one without
waiting for its answer (read before the next call's).

A helper that hangs is treated as gone. It touches a heartbeat file every second from a
thread of its own (`beat`); while this process waits for an answer it watches that file,
and when the file has not changed for MPSRUN_HELPER_STALL_S seconds (default 60) of this
process's monotonic clock (which stands still while a laptop sleeps), it kills the helper
and raises `_HelperGone`: the caller opens the store itself and the run goes on. A helper
busy on a long call (an upload) keeps beating and is waited for.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, BinaryIO, Callable

BEAT_ENV = "MPSRUN_HELPER_BEAT"  # the heartbeat file's path, for the helper
STALL_ENV = "MPSRUN_HELPER_STALL_S"



class _RemoteError(Exception):
    """An exception raised in the helper, carried back as its type name, message and traceback.

    Not unpickled as its own class: that would import mlflow here, which is what the helper avoids.
    """

    def __init__(self, type_name: str, message: str, tb: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.remote_traceback = type_name, tb


class _HelperGone(_RemoteError):
    """The helper process ended (or its pipe broke): nothing it answers any more."""


def send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack(">Q", len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    return decode(stream.read)


def decode(read: Callable[[int], bytes]) -> Any:
    """One message, read with `read(n)` (which returns fewer bytes only at the end of the pipe)."""
    head = read(8)
    if len(head) < 8:
        raise EOFError("the MLflow helper process closed its pipe")
    (n,) = struct.unpack(">Q", head)
    data = read(n)
    if len(data) < n:
        raise EOFError("the MLflow helper process closed its pipe mid-message")
    return pickle.loads(data)


def beat(path: str, every_s: float = 1.0) -> None:
    """The helper's heartbeat (a daemon thread): touch `path` while this process runs."""
    while True:
        try:
            os.utime(path, None)
        except OSError:
            return  # the training process removed it: it is ending
        time.sleep(every_s)


def read_exact(fd: int, n: int, stalled: Callable[[], str | None]) -> bytes:
    """n bytes from a pipe; b"" at end of file. `stalled()` is asked every second without data:
    a reason means give up (EOFError)."""
    buf = bytearray()
    while len(buf) < n:
        if os.name != "nt":  # select() does not take pipes on Windows: there, block
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                why = stalled()
                if why:
                    raise EOFError(why)
                continue
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return bytes(buf)
        buf += chunk
    return bytes(buf)


MAX_POSTED = 256  # unanswered posted calls at most (their answers, ~30 bytes each, stay far below a pipe's 64 KiB)


class _Posted:
    """A call sent without waiting for its answer; the answer is read before any later one."""

    def __init__(self, remote: "_Remote", method: str, args: tuple) -> None:
        self.remote, self.method, self.args = remote, method, args
        self.done, self.ok, self.value = False, True, None

    def result(self) -> Any:
        if not self.done:
            with self.remote._lock:
                self.remote._drain(self)
        if not self.ok:
            raise _RemoteError(*self.value)
        return self.value


class _Remote:
    """The helper process and its request/reply pipe: calls answered in order, one writer at a time.

    `post` sends without waiting (tags, params, metrics, texts: the training thread does not wait
    for SQLite); the answers are read, in order, before the next `call`'s, and a posted call that
    failed raises there. A helper that dies raises `_HelperGone`, and `unconfirmed()` lists the
    posted calls it may not have written.
    """

    def __init__(self, uri: str, experiment: str, artifact_root: str | None, warm: str | None = None) -> None:
        args = [sys.executable, "-m", "mpsrun.track.helper.process", uri, experiment, artifact_root or ""]
        fd, self._beat = tempfile.mkstemp(prefix="mpsrun-helper-beat-")
        os.close(fd)
        self._stall_s = float(os.environ.get(STALL_ENV, "60"))
        self._seen: tuple[int | None, float] = (None, time.monotonic())  # the beat file's mtime, and since when
        # Own session: a Ctrl-C at the terminal reaches the main process only, which then
        # marks the run KILLED through this helper. stderr is shared (MLflow's own notes).
        # Answers are read unbuffered, so that waiting on them can watch the heartbeat.
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                                     bufsize=0, env={**os.environ, BEAT_ENV: self._beat, **({"MPSRUN_HELPER_WARM": warm} if warm else {})})
        self._lock = threading.Lock()
        self._kinds: dict[str, bool] = {}
        self._posted: list[_Posted] = []  # sent, answer not read yet (oldest first)
        self._failed: _Posted | None = None  # a posted call that failed and nobody waits on

    def call(self, method: str, *args: Any) -> Any:
        return self._request(("call", method, args))

    def post(self, method: str, *args: Any) -> _Posted:
        with self._lock:
            self._open()
            if len(self._posted) >= MAX_POSTED:  # its answers fill a pipe the helper then blocks on: read them
                self._drain()
            p = _Posted(self, method, args)
            self._posted.append(p)
            try:
                send(self.proc.stdin, ("call", method, args))  # type: ignore[arg-type]
            except (BrokenPipeError, OSError) as e:
                self._gone(e)
            return p

    def unconfirmed(self) -> list[tuple[str, tuple]]:
        return [(p.method, p.args) for p in self._posted if not p.done]

    def kind(self, name: str) -> tuple[bool, Any]:
        """(True, None) for a method of the helper's Tracker, else (False, the attribute's value)."""
        if self._kinds.get(name):
            return True, None
        is_method, value = self._request(("get", name))
        if is_method:
            self._kinds[name] = True
        return is_method, value

    def values(self) -> dict[str, Any]:
        """The helper's Tracker's plain attributes (numbers, strings), read once before it ends."""
        return self._request(("vars", "", ()))

    def _open(self) -> None:
        if self.proc.stdin is None or self.proc.stdin.closed:
            raise _RemoteError("RuntimeError", "the MLflow helper process has been closed", "")

    def _receive(self) -> Any:
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        return decode(lambda n: read_exact(fd, n, self._stalled))

    def _stalled(self) -> str | None:
        """Why to stop waiting for the helper: its heartbeat stood still for the stall window (it is then killed)."""
        if self.proc.poll() is not None:
            return None  # ended: the read sees the end of the pipe
        try:
            mtime: int | None = os.stat(self._beat).st_mtime_ns
        except OSError:
            mtime = None
        now = time.monotonic()
        if mtime != self._seen[0]:
            self._seen = (mtime, now)
            return None
        if now - self._seen[1] < self._stall_s:
            return None
        self.proc.kill()
        return f"it stopped answering: no heartbeat for {now - self._seen[1]:.0f} s ({STALL_ENV}={self._stall_s:g}); killed"

    def _gone(self, e: BaseException) -> None:
        try:
            code: Any = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = "killed: its pipe broke"
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise _HelperGone("RuntimeError", f"the MLflow helper process ended (exit {code}): {why}", "") from None

    def _drain(self, upto: _Posted | None = None) -> None:
        """Read posted calls' answers (all, or up to `upto`); with the lock held."""
        while self._posted:
            p = self._posted[0]
            try:
                p.ok, p.value = self._receive()
            except (EOFError, OSError) as e:
                self._gone(e)
            p.done = True
            self._posted.pop(0)
            if not p.ok and p is not upto and self._failed is None:
                self._failed = p
            if p is upto:
                break

    def _request(self, msg: tuple) -> Any:
        with self._lock:
            self._open()
            try:
                self._drain()
                send(self.proc.stdin, msg)  # type: ignore[arg-type]
                ok, value = self._receive()
            except (EOFError, BrokenPipeError, OSError) as e:
                self._gone(e)
            failed, self._failed = self._failed, None
        if failed is not None:  # an earlier posted call failed: said now, by the next call that waits
            raise _RemoteError(*failed.value)
        if not ok:
            raise _RemoteError(*value)
        return value

    def close(self, wait: bool = True) -> None:
        try:
            os.unlink(self._beat)  # the helper's heartbeat thread stops at its next beat
        except OSError:
            pass
        with self._lock:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                try:
                    self.proc.stdin.close()  # EOF: the helper flushes and exits
                except OSError:
                    pass
            if not wait:
                return
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
