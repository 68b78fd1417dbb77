"""The MLflow helper process: `python -m mpsrun.track.helper.process URI EXPERIMENT ARTIFACT_ROOT`.

Started by `track.background` at the beginning of `mpsrun run`; imports mlflow and
opens the store at once, on its own core, while the main process imports torch and
builds data and model. Then it serves `store.Tracker` calls sent over stdin
(length-prefixed pickles) and answers each on the original stdout. Its fd 1 is
pointed at stderr so that nothing MLflow prints can corrupt the pipe.

It ignores SIGINT (the main process marks the run KILLED through it) and ends on
end-of-file: after writing the metrics (and system metrics) it still holds.

Once the store is open, a thread imports what the run's end needs (`hooks.warm`:
torch, torch.export, mlflow.pytorch, matplotlib) while the training process trains.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from mpsrun.track.helper.pipe import BEAT_ENV, beat, receive, send

if __name__ == "__main__" and os.environ.get(BEAT_ENV):  # first, before the imports below (a second or more):
    # the training process takes a helper whose heartbeat stops for one that hangs (track/helper/pipe.py)
    threading.Thread(target=beat, args=(os.environ[BEAT_ENV],), name="mpsrun-helper-beat", daemon=True).start()

from mpsrun.track.records import hooks  # noqa: E402

from mpsrun.track.store import client as store


WARM_ENV = "MPSRUN_HELPER_WARM"  # 0: no imports ahead of need (for measuring what warming buys); begin: only what `begin` needs


class _Trace:
    """With $MPSRUN_HELPER_TRACE=FILE (`{pid}` in it: one file per helper, as a sweep's workers each have one): one line per step (seconds since the helper started, the step's
    own seconds, what), to see where the helper's time goes (benchmarks, not tests)."""

    def __init__(self) -> None:
        self.path = os.environ.get("MPSRUN_HELPER_TRACE", "").replace("{pid}", str(os.getpid())) or None  # {pid}: a file per helper
        self.t0 = self.last = time.perf_counter()

    def mark(self, what: str) -> None:
        now = time.perf_counter()
        if self.path:
            with open(self.path, "a") as f:
                f.write(f"{now - self.t0:8.3f} {now - self.last:7.3f} {what}\n")
        self.last = now


trace = _Trace()


def _error(e: BaseException) -> tuple[bool, tuple[str, str, str]]:
    return False, (type(e).__name__, str(e), "".join(traceback.format_exception(type(e), e, e.__traceback__)))


def main(argv: list[str]) -> int:
    uri, experiment, artifact_root = argv[0], argv[1], argv[2] or None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reply_stream = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the reply pipe
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer

    setup_error: BaseException | None = None
    try:  # read-only warm-up: import, client, store checks; the experiment is created at "start"
        store.client(uri).get_experiment_by_name(experiment)
    except BaseException as e:
        setup_error = e
    tracker: store.Tracker | None = None
    if setup_error is None and os.environ.get(WARM_ENV, "1") != "0":
        # While the training process imports torch and trains, import what the end of the
        # run needs (torch, torch.export, mlflow.pytorch, matplotlib) on a thread: requests
        # are still answered in between, and a request needing a module waits for it.
        threading.Thread(target=hooks.warm, args=(trace.mark, os.environ.get(WARM_ENV) == "begin"), name="mpsrun-helper-warm", daemon=True).start()

    trace.mark("set-up")
    while True:
        try:
            msg = receive(requests)
        except EOFError:
            break
        kind, name, args = msg if len(msg) == 3 else (*msg, ())
        trace.mark(f"idle before {kind} {name} {args[0] if name == 'hook' else ''}")
        try:
            if tracker is None:
                if setup_error is not None:
                    raise setup_error
                tracker = store.Tracker(uri, experiment, artifact_root)
            if kind == "vars":
                plain = (int, float, str, bool, type(None))
                reply: Any = (True, {k: v for k, v in vars(tracker).items() if not k.startswith("_") and isinstance(v, plain)})
            elif kind == "get":
                value: Any = getattr(tracker, name)
                reply = (True, (True, None)) if callable(value) else (True, (False, value))
            else:
                reply = (True, getattr(tracker, name)(*args))
        except BaseException as e:
            reply = _error(e)
        trace.mark(f"{kind} {name} {args[0] if name == 'hook' else ''}")
        try:
            send(reply_stream, reply)
        except Exception as e:  # a reply that cannot be pickled: say so instead
            send(reply_stream, _error(TypeError(f"{name} returned an unpicklable {type(reply[1]).__name__}: {e}")))
    if tracker is not None:
        hooks.stop_system(tracker)
        tracker.flush()  # the main process ended without finish(): keep what was logged
    trace.mark(f"end of input; written; torch imported: {'torch' in sys.modules}")
    # Everything is written: skip tearing down torch, mlflow and SQLAlchemy module by module
    # (seconds), during which a caller reading this process's shared stderr would still wait.
    sys.stderr.flush()
    if os.environ.get(BEAT_ENV):
        try:
            os.unlink(os.environ[BEAT_ENV])  # also removed by the training process; whoever is first
        except OSError:
            pass
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
