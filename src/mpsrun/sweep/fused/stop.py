"""A fused group stopped by a signal: its records kept whole, its members' trials lost (retried), their runs KILLED.

SIGINT/SIGTERM raise in the worker's main thread wherever it is (train/keep/interrupt.py). A group's
bookkeeping (its runs created in one call to the MLflow helper, each epoch's metrics posted, each
ending member told to the study) is held against that (`held`): the signal is raised when the
step is done, so a run is never left without its trial knowing its id, nor an epoch half posted,
nor the journal's lock left behind. Training itself is not held: a signal stops it at once.
Then `abandon` posts every epoch the members finished and had not posted yet, ends their runs
KILLED and fails their trials as lost (not counted, queued again with the same values).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM wait; at its end the first one is handled as it would have been.

    A second signal within the block hands the first to its handler at once (interrupt.stop_on_signals
    then raises; a third exits without clean-up), so a step that hangs never holds the user back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.getsignal(s) for s in SIGNALS}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    def hold(signum: int, frame: Any) -> None:
        got.append(signum)
        if len(got) > 1:
            restore()
            _deliver(old[got[0]], got[0])

    for s in SIGNALS:
        signal.signal(s, hold)
    try:
        yield
    finally:
        restore()
        if len(got) == 1:
            _deliver(old[got[0]], got[0])


def _deliver(handler: Any, signum: int) -> None:
    """The signal to the handler it would have met (a callable, the default action, or ignored)."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)


def still_running(study: Any, trial: Any) -> bool:
    """Whether the study still has `trial` RUNNING (not told, not failed as lost by anyone)."""
    from optuna.trial import TrialState

    try:
        return study._storage.get_trial(trial._trial_id).state == TrialState.RUNNING  # noqa: SLF001 - the stored state, not this copy's
    except Exception:  # noqa: BLE001 - cannot tell: leave it to the next command's reap
        return False


def lose(study: Any, trials: list[Any], why: str) -> None:
    """Trials asked but never told (a signal came first): failed as lost, not counted, queued again."""
    from mpsrun.sweep import storage

    for t in trials:
        if still_running(study, t):
            storage.mark_lost(study, t, why)


def abandon(study: Any, tracker: Any, members: list[Any], posted: dict[int, int], notes: list[str], why: str) -> None:
    """Members a signal stopped: their finished epochs all posted, their runs ended KILLED (waited for), their trials lost.

    Finished: by every member. The group trains in lockstep, and the engine hands an epoch's metrics to its members one
    by one (each member's pruner report held against the signal on its own), so a signal in between left the first
    members one epoch ahead of the others (their runs' epochs_done 42 and 41: seen in CI); that epoch is not kept.
    """
    from mpsrun.sweep.fused import record

    done = min((len(m.history) for m in members), default=0)
    rows = [(m, e, m.history[e]) for m in members for e in range(posted.get(m.number, 0), done)]
    try:
        record.epoch(tracker, rows)
        for m in members:
            m.state, m.message = "KILLED", why
        record.end(tracker, members, notes, wait=True)
    except Exception as e:  # noqa: BLE001 - the helper is gone: the next command's publish settles the runs from the study
        sys.stderr.write(f"fused group: its runs could not be ended KILLED ({type(e).__name__}: {e}); the next sweep settles them\n")
    lose(study, [m.trial for m in members], why)
