"""One epoch's training phase under torch.profiler, for measuring where a step's time goes (issue 27).

Why: a missed speed target needs the profile that says why, taken in the real run (its
data, graphs, ranks), not in a separate script. `MPSRUN_PROFILE_EPOCH=E` (1-based)
profiles the training phase of epoch E (CPU and CUDA activity; kernels replayed from CUDA
graphs included where CUPTI reports them) and writes torch's table of operators and kernels,
sorted by device time, to `MPSRUN_PROFILE_OUT` (default `mpsrun-profile-rank{rank}.txt` in the
working directory; `{rank}` is this process's rank in a data-parallel job, 0 otherwise).
The profiled epoch is slower than the others (the profiler's own cost): the run says so in
its notes, and its figures for that epoch are not a measurement.

torch.profiler is imported only when the variable is set.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

EPOCH_ENV = "MPSRUN_PROFILE_EPOCH"
OUT_ENV = "MPSRUN_PROFILE_OUT"
ROWS = 60  # the table's rows: the kernels that take the time, not every operator


def wanted(epoch: int) -> bool:
    """Whether epoch `epoch` (0-based) is the one `MPSRUN_PROFILE_EPOCH` names (1-based)."""
    value = os.environ.get(EPOCH_ENV, "").strip()
    return value.isdigit() and int(value) == epoch + 1


def out_path(rank: int) -> Path:
    return Path((os.environ.get(OUT_ENV) or "mpsrun-profile-rank{rank}.txt").replace("{rank}", str(rank)))


@contextlib.contextmanager
def profiled(epoch: int, device: Any, rank: int, notes: list[str]) -> Iterator[None]:
    """Profile the block when `wanted(epoch)`; write the table when it ends."""
    if not wanted(epoch):
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if getattr(device, "type", "") == "cuda" else [])
    path = out_path(rank)
    with profile(activities=activities) as prof:
        yield
    sort = "self_device_time_total" if ProfilerActivity.CUDA in activities else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# epoch {epoch + 1}, rank {rank}, device {device}: the training phase under torch.profiler\n"
                    + prof.key_averages().table(sort_by=sort, row_limit=ROWS) + "\n")
    notes.append(f"profile: epoch {epoch + 1}'s training phase ran under torch.profiler ({EPOCH_ENV}); its table is {path}; "
                 "that epoch's time is not a measurement")
