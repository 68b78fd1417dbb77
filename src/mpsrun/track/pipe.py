"""The pipe between `mpsrun run` and its MLflow helper process (track/helper.py).

Length-prefixed pickles: requests on the helper's stdin, answers on its original stdout,
in order. `_Remote` starts the helper and carries calls; `post` sends one without
waiting for its answer (read before the next call's).
"""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys
import threading
from typing import Any, BinaryIO



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
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the MLflow helper process closed its pipe")
    (n,) = struct.unpack(">Q", head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the MLflow helper process closed its pipe mid-message")
    return pickle.loads(data)


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

    def __init__(self, uri: str, experiment: str, artifact_root: str | None) -> None:
        args = [sys.executable, "-m", "mpsrun.track.helper", uri, experiment, artifact_root or ""]
        # Own session: a Ctrl-C at the terminal reaches the main process only, which then
        # marks the run KILLED through this helper. stderr is shared (MLflow's own notes).
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
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

    def _gone(self, e: BaseException) -> None:
        try:
            code: Any = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = "killed: its pipe broke"
        raise _HelperGone("RuntimeError", f"the MLflow helper process ended (exit {code}): {type(e).__name__}", "") from None

    def _drain(self, upto: _Posted | None = None) -> None:
        """Read posted calls' answers (all, or up to `upto`); with the lock held."""
        while self._posted:
            p = self._posted[0]
            try:
                p.ok, p.value = receive(self.proc.stdout)  # type: ignore[arg-type]
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
                ok, value = receive(self.proc.stdout)  # type: ignore[arg-type]
            except (EOFError, BrokenPipeError, OSError) as e:
                self._gone(e)
            failed, self._failed = self._failed, None
        if failed is not None:  # an earlier posted call failed: said now, by the next call that waits
            raise _RemoteError(*failed.value)
        if not ok:
            raise _RemoteError(*value)
        return value

    def close(self, wait: bool = True) -> None:
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
