"""Per-shape checks of a fused group's own kernels (tconv's convolutions, the Triton max-pools, the SGD kernel),
and running them side by side.

Why one mechanism: both kernels are checked against the library's op once per shape, outside any CUDA graph
capture, and both give up for the whole group on a mismatch or a kernel Triton cannot build for this GPU (said
once, the group trains on with cuDNN's / torch's op: a compile error is no reason to fail a trial).

Why side by side: each kernel's first use compiles it (Triton's passes, ptxas, a launcher), 1-4 s a check on an
H200 on a fresh machine, 8.5 s in all for a small CNN's group, one after the other on the clock of the sweep's
first epoch. Triton's compile releases the interpreter lock (two compiles on two threads: 7.5 s against 14 s one
after the other on the 2-core development machine), so a capture's warm-up first runs one forward on the library's
ops that only collects the shapes (`discovering`), then the pending checks on threads (`run_pending`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch


def brief(e: BaseException) -> str:
    """An exception as one line for a note: its type and the first line of its message, at most 200 characters."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


class Checked:
    """Which shapes passed their check, which wait for one (`pending`, while `discover` is on), and whether the
    kernels were given up (`off`, said once through `say` as `fallback (why)`)."""

    fallback = "the group's own kernels are not used"
    mismatch: tuple[type[BaseException], ...] = ()  # whose message is the whole reason (other errors: brief(e))
    # whether this owner's pending checks run side by side (they compile different kernels), or one after another on
    # one thread (every shape compiles the same kernels: the first compiles them, the rest find them built; side by side
    # each would compile them again, competing for the interpreter lock: 4.2 s for a group's checks on an H200, not 3.6)
    together = True

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.checked: set[tuple] = set()
        self.pending: dict[tuple, Callable[[], None]] = {}
        self.discover = False
        self.off: str | None = None

    def ready(self, key: tuple, run: Callable[[], None], cuda: bool) -> bool:
        """Whether a call at `key` may take the kernels; `run` checks them at this shape (raises when they may not);
        `cuda`: whether the call's tensors are on a CUDA device (where a capture may be under way)."""
        if self.off is not None:
            return False
        if key in self.checked:
            return True
        if cuda and torch.cuda.is_current_stream_capturing():  # never a guess inside a graph
            return False
        if self.discover:
            self.pending.setdefault(key, run)
            return False
        try:
            run()
        except Exception as e:  # noqa: BLE001 - a mismatch, or a kernel Triton cannot build for this GPU
            self.failed(e)
            return False
        self.checked.add(key)
        return True

    def failed(self, e: BaseException) -> None:
        if self.off is None:
            self.off = str(e) if isinstance(e, self.mismatch) else brief(e)
            self.say(f"{self.fallback} ({self.off})")


@contextlib.contextmanager
def discovering(owners: list[Checked]) -> Iterator[None]:
    """The block's calls only collect the shapes not yet checked; the library's ops run meanwhile, cuDNN without
    its time-trials (`cudnn.benchmark` off: shapes and paths the run will not keep)."""
    bench = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    for o in owners:
        o.discover = True
    try:
        yield
    finally:
        for o in owners:
            o.discover = False
        torch.backends.cudnn.benchmark = bench


def run_pending(owners: list[Checked], device: torch.device, prepare: Callable[[], None] | None = None) -> int:
    """Every pending check of `owners`, each on its own thread (Triton compiles side by side); the results taken
    in order on this thread (a failure gives up that owner's kernels, said once). Returns how many ran.

    `prepare` runs first on this thread (building the kernels' Python objects once, so threads share them)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(o, key, run) for o in owners if o.together for key, run in o.pending.items()]
    jobs += [(o, tuple(o.pending), _in_turn(list(o.pending.values()))) for o in owners if not o.together and o.pending]
    for o in owners:
        o.pending = {}
    if not jobs:
        return 0
    if prepare is not None:
        try:
            prepare()
        except Exception as e:  # noqa: BLE001 - Triton's kernels cannot even be defined here: none of them is used
            for o in owners:
                o.failed(e)
            return 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the checks' own tensors only; nothing of the step's left in flight

    def one(run: Callable[[], None]) -> None:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            run()

    bench = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False  # a reference, not the run's kernels (and one setting for every thread)
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=min(len(jobs), 8), thread_name_prefix="mpsrun-check") as ex:
            futures = [(o, key, ex.submit(one, run)) for o, key, run in jobs]
            for o, key, f in futures:
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001 - as Checked.ready: said once, the group goes on without them
                    o.failed(e)
                else:
                    o.checked.update(key if not o.together else (key,))
    finally:
        torch.backends.cudnn.benchmark = bench
    from mpsrun.sweep import trace

    if trace.enabled():
        trace.emit(f"sweep-trace-checks threads={len(jobs)} s={time.perf_counter() - t0:.3f}")
    return len(jobs)


def _in_turn(runs: list[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for r in runs:
            r()
    return run
