"""Worker 0's head start: torch, its data and a fused CUDA group's first compiles, while the command opens the study
and the parent run.

Why: worker 0 runs in the launching command and starts once the study and the parent run exist; until then the
command waits on its MLflow helper (mlflow's import, the store: seconds). One thread uses that wait: it imports
the training side (torch, the runner), builds the data the worker would build first (1.4 s for the CNN benchmark's
60,000 synthetic images on the H200 machine) and, where trials fuse on CUDA, rehearses the first group: members
built from the recipe as written (their own seeds where the sweep searches `seed`), its kernels checked at its
shapes and two warm-up steps run, as its first capture would. On a fresh machine those checks are first compiles
(2.5-3.3 s for 16 CNN members on the H200); what they leave is per process (Triton's compiled kernels, cuDNN's
plans, the CUDA context, the library's loaded kernels), so the real group's checks find their kernels built.
The rehearsal is thrown away: no trial, no run, its memory given back before the worker measures free memory.
Where trials do not fuse, the thread begins torch._dynamo's import instead (torch's optimizers import it when
built: worker 0 waited 4.7 s for it on the H200 machine, begun only once the parent run existed). Where trials fuse
and the thread is done before the parent run is open, it imports matplotlib for the parent's figures at the end.

Nothing of it runs beside the worker: `take()` waits for the thread before the worker's first torch work (the
seeds and cuDNN's settings are process-wide) and hands the data over. Any failure here is left to the worker,
which meets it again on its own path and says it there.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from mpsrun.recipe.load import Resolved


class _Head:
    def __init__(self, resolved: Resolved, workers: int, target: int, where: Callable[[], dict[str, Any]]) -> None:
        self.resolved, self.workers, self.target, self.where = resolved, workers, target, where
        self.placement: dict[str, Any] | None = None
        self.cache: Any = None
        self.wanted = threading.Event()  # worker 0 is waiting for this thread (take): nothing optional starts after
        self.thread = threading.Thread(target=self._run, name="mpsrun-head-start", daemon=True)

    def _run(self) -> None:
        from mpsrun.sweep import trace

        try:
            import mpsrun.sweep.trial  # noqa: F401 - torch and the runner (loading shared libraries leaves the interpreter free)
        except Exception:  # noqa: BLE001 - the worker imports it again and says why
            return
        trace.mark("training_imported")
        sweep = self.resolved.recipe.sweep
        fusing = sweep is not None and sweep.fuse != "off"
        if fusing:
            _triton_beside()
        else:  # unfused trials build torch optimizers, which import torch._dynamo: begun now, not when worker 0 starts
            from mpsrun.train import warm

            warm.dynamo()
        try:
            from mpsrun.recipe.sweep import trial_recipe
            from mpsrun.sweep.trial import DataCache

            placement = self.where()
            cache = DataCache()
            cache.get(trial_recipe(self.resolved, placement))
        except Exception:  # noqa: BLE001 - bad input or a dataset that fails: the worker's own build says it
            return
        self.placement, self.cache = placement, cache
        trace.mark("data_built")
        if fusing:
            t0 = time.perf_counter()
            said = rehearse(self.resolved, placement, cache, self.target, self.workers)
            if trace.enabled():
                trace.emit(f"sweep-trace-rehearsal s={time.perf_counter() - t0:.3f} {said}")
            if not self.wanted.is_set():  # the parent run is not open yet: the figures' import, off the sweep's end
                figures_import()
                trace.mark("figures_imported")


def figures_import() -> None:
    """matplotlib's pyplot (Agg), which the parent's figures import after the last trial (0.4 s of a 2-core machine's
    fused digits sweep, about 4 s in all), imported ahead where the command would otherwise wait (here; drive, while
    the extra workers end). The head start does it only where trials fuse: beside torch._dynamo's import (unfused
    sweeps) it would slow that one, which worker 0 waits for."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except Exception:  # noqa: BLE001 - the figures import it again and say why
        pass


def _triton_beside() -> None:
    """Triton's cache key and CUDA driver on a thread of their own (train/warm.py), beside the data's build."""
    try:
        import torch

        if torch.cuda.is_available():
            from mpsrun.train import warm

            warm.triton_key()
    except Exception:  # noqa: BLE001 - the group's first kernel does it, as it would have
        pass


_head: _Head | None = None


def start(resolved: Resolved, workers: int, target: int, where: Callable[[], dict[str, Any]]) -> None:
    """Begin the head start on a thread (a previous command's in this process waited for first). `where()`, called on
    the thread: worker 0's placement (worker.placement), which the worker's own must equal for it to take the data."""
    global _head
    if _head is not None:
        _head.thread.join()
    _head = _Head(resolved, workers, target, where)
    _head.thread.start()


def take(placement: dict[str, Any]) -> Any:
    """Wait for the head start and return its data cache (a trial.DataCache), or None where there was none or it was
    built for another placement; the head start is then over (a later command starts its own)."""
    global _head
    head, _head = _head, None
    if head is None:
        return None
    head.wanted.set()
    head.thread.join()
    return head.cache if head.placement == placement else None


def rehearse(resolved: Resolved, placement: dict[str, Any], cache: Any, target: int, workers: int) -> str:
    """The first fused group's checks and warm-up steps at its shapes (CUDA groups replayed as graphs only); its
    objects dropped and the device's cached memory given back. Returns a few words for the trace."""
    try:
        from mpsrun.devices import resolve as devices
        from mpsrun.recipe.sweep import trial_recipe
        from mpsrun.sweep.fused import work as fused

        r = trial_recipe(resolved, placement).recipe
        device = devices.resolve(r.device, r.device_fallback).device
        if device.type != "cuda" or r.graphs is False:  # the kernels, checks and captures are CUDA graphs' only
            return f"skipped (a {device.type} group{', graphs: false' if r.graphs is False else ''})"
        most, _ = fused.size(resolved, placement, cache)
        n, _ = fused.group_size(most, target, 0, 0, workers, resolved.recipe.sweep.pruner if resolved.recipe.sweep else "none")
        mems = fused.stand_ins(resolved, placement, n)
    except Exception as e:  # noqa: BLE001 - the worker's group meets it again
        return f"skipped ({type(e).__name__}: {e})"
    if not mems:
        return "skipped (no member)"
    from mpsrun.sweep.fused import graphed, members
    from mpsrun.sweep.trial import data_key

    said: list[str] = []
    b = g = None
    try:
        data = {data_key(m.resolved): cache.splits for m in mems}  # its own seeds' data: the same shapes, not built again
        b = members.build(mems, data)
        g, _ = graphed.group_for(b, said.append)
        if not isinstance(g, graphed.GraphedGroup):
            return "skipped (graphs off)"
        graphed.rehearse(g)
        return f"members={n}" + (f" said={' | '.join(said)[:300]}" if said else "")
    except Exception as e:  # noqa: BLE001 - Unfusable, out of memory, a kernel that fails: the worker's group says it
        return f"failed ({type(e).__name__}: {str(e)[:200]})"
    finally:
        device = getattr(b, "device", None)
        del g, b
        if device is not None and device.type == "cuda":
            import gc

            import torch

            gc.collect()
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # `auto` group size reads the device's free memory next
