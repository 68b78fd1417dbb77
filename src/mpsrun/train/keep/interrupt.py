"""SIGINT and SIGTERM during training: stop, checkpoint, flush, mark the run KILLED, exit 130 or 143.

SIGTERM is what Slurm preemption, `docker stop` and Kubernetes send; by default
Python dies on it at once, losing buffered metrics and leaving the run RUNNING.
Here the first signal raises `Interrupted` (a KeyboardInterrupt, so every existing
Ctrl-C path cleans up the same way) in the main thread: the current step is
abandoned, the runner waits for the last checkpoint, flushes the metrics and marks
the run KILLED. A second signal while that happens ends the process at once
(`os._exit`), for when the clean-up itself hangs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator

from mpsrun.exitcodes import EXIT_INTERRUPT, EXIT_TERM

EXIT = {signal.SIGINT: EXIT_INTERRUPT, signal.SIGTERM: EXIT_TERM}


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal; `exit_code` is 128 + its number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(self.name)


def exit_code(e: BaseException) -> int:
    """130 for Ctrl-C (and a plain KeyboardInterrupt), 143 for SIGTERM."""
    return getattr(e, "exit_code", EXIT_INTERRUPT)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM raise Interrupted once; a second one exits at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    first: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if first:
            sys.stderr.write(f"\n{signal.Signals(signum).name} again: stopping now, without clean-up\n")
            sys.stderr.flush()
            os._exit(EXIT.get(signum, 128 + signum))
        first.append(signum)
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in EXIT}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
