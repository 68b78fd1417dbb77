"""The fused group's steps replayed as CUDA graphs: the gather, forward, backward and update of many steps at once.

Why: eager, one fused step is dozens of small kernel launches issued from Python; the solo trials a
group replaces run under CUDA graphs (train/loop/steps.py), so on one H200 an eager group lost to them
(16 CNN trials fused: 0.94x the trials per second of the one-worker sweep). Here each graph holds
GRAPH_STEPS whole steps and reads the steps' sample indices from a static tensor: before a replay the
epoch's permutation (each stream's, already on the device) is copied into it, one device copy, so the
rows are gathered inside the graph. Validation replays the same way over the validation rows in order.

Members that leave the group (pruned, diverged) change every shape: the graphs are dropped and captured
again, on the first step that needs them, for the members that remain. A capture that fails (an
operation that reads the host, a loss that cannot be captured) leaves the group eager for the rest of
its run: said on screen and in the members' notes, never silent.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch

from mpsrun.sweep.fused.engine import Group
from mpsrun.sweep.fused.members import Built

GRAPH_STEPS = 16  # steps per replay for one member, as the solo engine's graphs (train/loop/steps.py); fewer for more
PER_STEP = "graphs: a per-step schedule changes the rate inside a replay of several steps: the fused step runs eager"
# As a solo run (assemble.adjust_options): a replay's steps would have to fall on the groups' edges, with their weights.
ACCUMULATE = "graphs: accumulate: {k} steps the optimizer every {k} micro-batches, which the replays do not model: the fused step runs eager"
WARMUP = 2  # eager steps on a side stream before a capture: lazy state (optimizer, cuBLAS handles) exists first


def wanted(b: Built) -> tuple[bool, str]:
    """Whether this group replays as CUDA graphs, and the note that says so (or why not)."""
    if b.device.type != "cuda":
        return False, ""
    choice = b.members[0].resolved.recipe.graphs
    if choice is False:
        return False, "graphs: off in the recipe (graphs: false): the fused step runs eager"
    if b.schedules is not None and b.schedules.per_step:  # a replay holds several steps; the rate is read per replay
        return False, PER_STEP
    if b.accumulate > 1:
        return False, ACCUMULATE.format(k=b.accumulate)
    return True, f"graphs: the fused step replays as CUDA graphs ({GRAPH_STEPS} steps a replay, the batch gathered inside)"


def group_for(b: Built, say: Callable[[str], None]) -> tuple[Group, str]:
    """The group that trains `b` (graphed on CUDA unless the recipe says graphs: false) and its note."""
    on, note = wanted(b)
    if note in (PER_STEP, ACCUMULATE.format(k=b.accumulate)):
        say(note)  # a fallback, as a failed capture's: in the parent's notes once (the members' carry `note`)
    if b.device.type == "cuda" and any(isinstance(layer, torch.nn.Conv2d) for layer in b.stacked.layers):
        r = b.members[0].resolved.recipe
        torch.backends.cudnn.benchmark = r.cudnn_benchmark is not False  # as a solo conv run resolves `auto` on CUDA
        b.stacked.pack = True  # convolution stages packed by member, channels_last as a solo conv run on CUDA has it
        b.stacked.channels_last = r.channels_last is not False
        if on:
            from mpsrun.sweep.fused.packed import FastPools
            from mpsrun.train import warm

            warm.triton_key()  # on a thread while the group starts: the first kernel's launch would compute it

            why = FastPools.why_not(b.stacked.layers, b.device, b.stacked.channels_last)
            if why is None:
                b.stacked.pools = FastPools(b.stacked.layers, say)
                note += "; max-pools as the solo engine's Triton kernels (checked against torch's at each shape)"
            elif why not in ("no max-pool", "not a CUDA channels_last group"):
                note += f"; pools: torch's max-pool kernels, not the fused ones ({why})"
            from mpsrun.sweep.fused.kernels import convcheck

            why = convcheck.why_not(b.stacked.layers, b.device, b.stacked.channels_last, b.amp or torch.float32)
            if why is None:
                half = b.amp is not None and b.amp != torch.float32
                b.stacked.convs = convcheck.Convs(say, half)
                note += ("; convolutions as Triton implicit-GEMM kernels (checked against cuDNN at each shape)" if half else
                         "; few-channel convolutions as Triton implicit-GEMM kernels in TF32 (checked against cuDNN at each shape), the rest cuDNN's")
            elif why != "not a CUDA channels_last group":
                note += f"; convolutions: cuDNN's, not the fused Triton kernels ({why})"
    if on:
        note += _sgd_kernel(b, say)
    b.graphs = on  # type: ignore[attr-defined] - the members' resolved.graphs parameter (record.begin)
    return (GraphedGroup(b, say) if on else Group(b)), note


def _sgd_kernel(b: Built, say: Callable[[str], None]) -> str:
    """SGD's update as one Triton kernel a parameter (kernels/tsgd.py) where it can be; the note's words."""
    opt = b.opt
    if getattr(opt, "kind", None) != "sgd" or getattr(opt, "exact", True) or b.device.type != "cuda":
        return ""
    from mpsrun.train.kernels import kernels_off

    why = kernels_off("MPSRUN_FUSED_OPTIM")
    if why is not None:
        return f"; optimizer: SGD's update as torch's ops ({why})"
    from mpsrun.sweep.fused.kernels import tsgd

    opt.kernel = tsgd.Sgd(say, opt.reference)
    return "; optimizer: SGD's update as one Triton kernel a parameter (checked against torch's ops)"


class GraphedGroup(Group):
    def __init__(self, b: Built, say: Callable[[str], None]) -> None:
        super().__init__(b)
        self.say = say
        self.graphs: dict[tuple[str, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None
        self.eager: str | None = None  # why the group fell back to eager (None: graphs)
        # the streams the graphs were captured for: (the members' (source, seed) keys, pairs, which) — the same
        # tensors while the members stay (graphs hold them)
        self.layout: tuple[tuple, list[tuple[int, int]], torch.Tensor | None] | None = None
        self.val_sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.dropout = any(p and max(p) > 0 for p in b.stacked.p_drop)
        self.capture_s = 0.0  # warm-up steps and captures, all graphs (MPSRUN_SWEEP_TRACE's group line)

    # -- streams: the same tensors while the members stay (graphs hold them)
    def _streams(self) -> tuple[list[tuple[int, int]], torch.Tensor | None]:
        key = tuple((m.source, m.seed) for m in self.active)
        if self.layout is None or key != self.layout[0]:
            self._drop()
            self.layout = (key, *super()._streams())
        return self.layout[1], self.layout[2]

    def _drop(self) -> None:
        self.graphs.clear()
        self.pool = None
        self.val_sums = None

    def _leave(self, ended: list[int]) -> None:
        super()._leave(ended)
        self.layout = None  # every stacked tensor is new: capture again for those who remain
        self._drop()

    # -- training
    def _train_epoch(self, pairs: list[tuple[int, int]], which: torch.Tensor | None, perm: torch.Tensor) -> None:
        if self.eager is None:
            try:
                self._replay("train", pairs, which, perm, self.ntr)
                return
            except _CaptureFailed as e:
                self._fall_back(e)
        super()._train_epoch(pairs, which, perm)

    @torch.no_grad()
    def _validate(self, pairs: list[tuple[int, int]], which: torch.Tensor | None) -> list[dict[str, float]]:
        if self.eager is not None or self.b.ce is None:  # each member's own metric objects: eager, as before
            return super()._validate(pairs, which)
        self.b.stacked.eval()
        if self.val_sums is None:
            m = len(self.active)
            dev = self.b.device
            self.val_sums = (torch.zeros(m, device=dev), torch.zeros(m, dtype=torch.long, device=dev), torch.zeros(m, dtype=torch.long, device=dev))
        for t in self.val_sums:
            t.zero_()
        order = torch.arange(self.nva, device=self.b.device).expand(len(pairs), self.nva)
        try:
            self._replay("val", pairs, which, order, self.nva)
        except _CaptureFailed as e:
            self._fall_back(e)
            return super()._validate(pairs, which)
        return self._val_metrics(*self.val_sums)

    def _fall_back(self, e: Exception) -> None:
        self.eager = str(e)
        self._drop()
        self.say(f"graphs: capturing the fused step failed ({e}); this group runs eager")

    # -- the replays
    def _groups(self, n: int) -> list[tuple[int, int]]:
        """(steps per replay, batch size) for an epoch of n rows. Why fewer steps per graph for more members: a
        replay of one M-member step is already M steps' work (launches no longer count), and each graph's
        capture records its steps one by one, on the clock of the sweep's first epoch."""
        bs = self.b.batch_size
        full = n // bs
        k = max(1, GRAPH_STEPS // max(1, len(self.active)))
        return [(k, bs)] * (full // k) + [(1, bs)] * (full % k) + ([(1, n % bs)] if n % bs else [])

    def _replay(self, kind: str, pairs: list[tuple[int, int]], which: torch.Tensor | None, order: torch.Tensor, n: int) -> None:
        i = 0
        s = order.shape[0]
        for k, bs in self._groups(n):
            g, idx = self._graph(kind, k, bs, pairs, which)
            idx.copy_(order[:, i : i + k * bs].reshape(s, k, bs).transpose(0, 1))
            g.replay()
            i += k * bs

    def _step(self, kind: str, pairs: list[tuple[int, int]], which: torch.Tensor | None, idx: torch.Tensor) -> None:
        """One step on the rows `idx` [S, bs]: what a replay repeats."""
        if kind == "train":
            self._train_step(*self._batch(*self._gather(pairs, idx, 0), which))
            return
        x, y = self._batch(*self._gather(pairs, idx, 2), which)
        with self.amp():
            self._val_sums(self.b.stacked(x), y, *self.val_sums)  # type: ignore[misc]

    def _graph(self, kind: str, k: int, bs: int, pairs: list[tuple[int, int]], which: torch.Tensor | None) -> tuple:
        key = (kind, k, bs)
        if key in self.graphs:
            return self.graphs[key]
        from mpsrun.sweep import trace

        tracing = trace.enabled()  # the warm-up (checks, compiles, cuDNN's plans) and the capture apart, synchronised
        t0 = t1 = time.perf_counter()
        dev = self.b.device
        idx = torch.zeros(k, len(pairs), bs, dtype=torch.long, device=dev)  # row 0 for the warm-up: any valid row
        snap = self._snapshot()
        try:
            with torch.no_grad() if kind == "val" else contextlib.nullcontext():
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    self._check_kernels(kind, pairs, which, idx[0])
                    for _ in range(WARMUP):
                        self._step(kind, pairs, which, idx[0])
                torch.cuda.current_stream(dev).wait_stream(side)
                if tracing:
                    torch.cuda.synchronize(dev)
                    t1 = time.perf_counter()
                self.b.opt.zero_grad()
                g = torch.cuda.CUDAGraph()
                if self.dropout and kind == "train" and self.b.stacked.generators:
                    for gen in self.b.stacked.generators:  # each member's own dropout generator advances per replay
                        g.register_generator_state(gen)
                with torch.cuda.graph(g, pool=self.pool):
                    for j in range(k):
                        self._step(kind, pairs, which, idx[j])
                self.pool = g.pool()
        except Exception as e:  # noqa: BLE001 - any capture failure: eager from here on, said (not a failed trial)
            with contextlib.suppress(Exception):  # a capture that broke may leave an error to collect
                torch.cuda.synchronize(dev)
            from mpsrun.devices import graph_rng

            graph_rng.unstick(dev, self.b.stacked.generators or [])  # the fallback drops every graph (_fall_back)
            self._restore(snap)
            raise _CaptureFailed(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from e
        self._restore(snap)  # the warm-up's steps taught nothing; the captured ones did not run
        self.graphs[key] = (g, idx)
        self.capture_s += time.perf_counter() - t0
        if tracing:
            trace.emit(f"sweep-trace-capture kind={kind} steps={k} batch={bs} members={len(self.active)} warmup={t1 - t0:.3f} "
                       f"capture={time.perf_counter() - t1:.3f}")
        return self.graphs[key]

    def _check_kernels(self, kind: str, pairs: list[tuple[int, int]], which: torch.Tensor | None, idx: torch.Tensor) -> None:
        """The group's own kernels (convolutions, max-pools) checked at every shape this graph meets, side by side:
        one forward on the library's ops collects the shapes, then each check (a first compile) runs on its own
        thread (kernels/checked.py)."""
        st, opt = self.b.stacked, self.b.opt
        owners = [o for o in (st.convs, st.pools, getattr(opt, "kernel", None)) if o is not None and o.off is None]
        if not owners:
            return
        from mpsrun.sweep.fused.kernels import checked

        # the forward alone (the kernels' calls are decided there), in eval mode: no dropout draw, no batch-norm
        # statistic moves; the backward's cuDNN calls would only plan kernels the run never takes
        was = st.training
        st.eval()
        try:
            with checked.discovering(owners), torch.no_grad(), self.amp():
                st(self._batch(*self._gather(pairs, idx, 0 if kind == "train" else 2), which)[0])
                if kind == "train" and getattr(opt, "kernel", None) is not None:
                    opt.kernel.expect(opt)
        finally:
            st.train(was)
        checked.run_pending(owners, self.b.device, _build_kernels)

    # -- what a warm-up changes, undone in place (the graphs keep pointers to these very tensors)
    def _snapshot(self) -> dict[str, Any]:
        st = self.b.stacked
        opt = self.b.opt
        tensors = [t for slot in st.where for t in slot.values()] + [self.loss_sum, opt.step_t]
        if self.b.clip is not None:
            tensors.append(self.b.clip.peak)  # the warm-up's norms are not the epoch's
        if self.val_sums is not None:
            tensors += list(self.val_sums)
        return {"tensors": [(t, t.detach().clone()) for t in tensors], "state": [{k: t.clone() for k, t in s.items()} for s in opt.state],
                "step_count": opt.step_count}

    @torch.no_grad()
    def _restore(self, snap: dict[str, Any]) -> None:
        for t, saved in snap["tensors"]:
            t.copy_(saved)
        opt = self.b.opt
        for st, before in zip(opt.state, snap["state"]):
            for name, t in st.items():
                if name in before:
                    t.copy_(before[name])
                else:
                    t.zero_()  # made by the warm-up: a fresh optimizer's state starts at zero (optim.py counts the first step)
        opt.step_count = snap["step_count"]
        opt.zero_grad()


class _CaptureFailed(Exception):
    pass


def rehearse(g: GraphedGroup) -> None:
    """A first training capture's warm-up without the capture, for a group that is then thrown away (sweep/head.py):
    the kernels' checks at its shapes and WARMUP eager steps on a side stream, as `_graph` runs them. What it leaves
    is the process's (compiled kernels, cuDNN's plans, the library's loaded kernels), not the group's."""
    dev = g.b.device
    pairs, which = g._streams()
    idx = torch.zeros(len(pairs), g.b.batch_size, dtype=torch.long, device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        g._check_kernels("train", pairs, which, idx)
        for _ in range(WARMUP):
            g._step("train", pairs, which, idx)
    torch.cuda.synchronize(dev)


def _build_kernels() -> None:
    """The kernels' Python objects made once, on this thread, before checks on threads use them (each thread would
    otherwise make its own, and Triton compile each twice); Triton's cache key waited for (started at group_for)."""
    from mpsrun.sweep.fused.kernels import tconv, tsgd
    from mpsrun.train import warm
    from mpsrun.train.kernels import fused_pool

    tconv._build()
    tsgd._build()
    fused_pool._build()
    warm.wait_triton()
