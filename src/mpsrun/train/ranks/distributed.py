"""Data-parallel training through torch.distributed: who am I, the process group, reductions.

A job is N copies of `mpsrun run` started by torch's own elastic launcher (`mpsrun run
--nproc N` calls it, `torchrun` is the same agent); each reads its rank from the
environment the launcher sets. Everything here is a no-op in a single process, so the
runner and engine call it unconditionally.

Why these choices:
- gloo on the CPU, NCCL on CUDA with one GPU per local rank; MPS has no multi-process
  backend, so asking for it is bad input (exit 2), not a silent CPU run.
- Collectives have a timeout (`MPSRUN_DIST_TIMEOUT_S`, default 300 s): a rank that
  dies must take the job down, never leave the others waiting forever.
- A rank that fails writes `mpsrun/failed/<rank>` into the job's c10d store (the
  rendezvous store every rank already shares, on one node or many) before it exits,
  so rank 0, the one process that talks to MLflow, can name the rank in the FAILED run.
- Rank 0 alone creates the MLflow run (train/ranks/job_run.py); a rank ends through
  train/ranks/teardown.py.
"""

from __future__ import annotations

import datetime
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ENV_TIMEOUT = "MPSRUN_DIST_TIMEOUT_S"
ENV_RUN_FILE = "MPSRUN_RUN_ID_FILE"  # set by `--nproc`: rank 0 writes the run id there for the launcher
FAILED_KEY = "mpsrun/failed/"


class PeerFailed(Exception):
    """This rank stopped because the job is going down (another rank failed, or the launcher said stop)."""


@dataclass(frozen=True)
class Context:
    """Where this process sits in the job (from the launcher's environment)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    nodes: int

    @property
    def main(self) -> bool:
        return self.rank == 0


_ctx: Context | None = None
_backend: str | None = None
_joined = False  # this process joined a job's group (stays True after shutdown: train/ranks/teardown.py ends it)


def from_env(env: dict[str, str] | None = None) -> Context | None:
    """The launcher's view of this process; None when not launched as one of several ranks."""
    e = os.environ if env is None else env
    try:
        world = int(e.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    if world <= 1 or "RANK" not in e:
        return None
    local_world = int(e.get("LOCAL_WORLD_SIZE", world))
    nodes = int(e.get("GROUP_WORLD_SIZE", max(1, world // max(local_world, 1))))
    return Context(int(e["RANK"]), int(e.get("LOCAL_RANK", "0")), world, local_world, nodes)


def context() -> Context | None:
    """The job this process belongs to once `init` ran (None in a single process)."""
    return _ctx


def backend() -> str | None:
    """The job's backend (gloo, nccl) once `init` ran."""
    return _backend


def world_size() -> int:
    return _ctx.world_size if _ctx else 1


def rank() -> int:
    return _ctx.rank if _ctx else 0


def joined() -> bool:
    """True once this process joined a job's process group (even after `shutdown`)."""
    return _joined


def is_main_process() -> bool:
    """True on rank 0 and in a single process: the one that logs to MLflow and writes checkpoints."""
    return _ctx is None or _ctx.main


def backend_for(device_type: str) -> str:
    """gloo for the CPU, NCCL for CUDA; ValueError (bad input) for MPS and anything else."""
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "nccl"
    if device_type == "mps":
        raise ValueError(
            "MPS has no multi-process backend in torch.distributed (no NCCL or gloo on Apple GPUs); "
            "run one process, or use device=cpu (gloo) or CUDA GPUs (NCCL) for --nproc/torchrun"
        )
    raise ValueError(f"no torch.distributed backend for device type '{device_type}'")


def check_batch(batch_size: int, world: int) -> str | None:
    """Why `batch_size` (the global batch) cannot be shared by `world` ranks, or None."""
    if batch_size % world:
        lo = batch_size - batch_size % world
        return (
            f"batch_size {batch_size} is the global batch and cannot be shared evenly by {world} ranks "
            f"(each takes batch_size / {world}); use a multiple of {world}, e.g. batch_size={lo or world} or {lo + world}"
        )
    return None


def timeout_s() -> float:
    return float(os.environ.get(ENV_TIMEOUT, "300"))


def place(device: torch.device, ctx: Context) -> tuple[torch.device, str | None]:
    """This rank's device: CUDA gets one GPU per local rank; returns a note when the request was rewritten."""
    backend_for(device.type)  # raises for MPS
    if device.type != "cuda":
        return device, None
    count = torch.cuda.device_count()
    if ctx.local_rank >= count:
        raise ValueError(f"{ctx.local_world_size} processes on this node but only {count} CUDA device(s); one GPU per local rank")
    chosen = torch.device("cuda", ctx.local_rank)
    torch.cuda.set_device(chosen)
    note = None
    if device.index is not None and device.index != ctx.local_rank:
        note = f"distributed: device {device} requested; rank {ctx.rank} uses {chosen} (one GPU per local rank)"
    return chosen, note


def join(ctx: Context, choice: Any, batch_size: int) -> list[str]:
    """Check the job can run (batch shares, backend), put this rank on its device, join the group.

    `choice` is the runner's DeviceChoice; its device is rewritten to this rank's.
    Raises ValueError (bad input: exit 2) before any collective.
    """
    problem = check_batch(batch_size, ctx.world_size)
    if problem:
        raise ValueError(problem)
    device, note = place(choice.device, ctx)
    choice.device = device
    init(ctx, device)
    return [note] if note else []


def adjust_options(options: Any, requested_graphs: Any) -> None:
    """CUDA graphs under data parallel: kept on NCCL (the all-reduce is captured with the step,
    train/ranks/graph_sync.py), recorded as a note; anywhere else a stated fallback to eager DDP.

    `MPSRUN_DDP_GRAPHS=0` keeps DDP's eager, overlapped all-reduce on NCCL too (the comparison).
    """
    if _ctx is None or not options.graphs:
        return
    if _backend == "nccl" and os.environ.get("MPSRUN_DDP_GRAPHS", "1") != "0":
        options.notes.append(
            f"graphs: each of the {_ctx.world_size} ranks replays its captured steps; gradients are averaged by NCCL "
            "all-reduces inside the graph, per bucket as backward fills it (train/ranks/graph_sync.py), not by DDP"
            f" ({GRAPH_MIXING}={os.environ.get(GRAPH_MIXING, 'unset')})"
        )
        return
    options.graphs = False
    how = "asked for" if requested_graphs is True else "auto"
    why = "MPSRUN_DDP_GRAPHS=0" if _backend == "nccl" else f"the {_backend} backend's collectives cannot be captured"
    options.notes.append(
        f"graphs: CUDA graphs ({how}) are not captured under DDP (world size {_ctx.world_size}, {why}); "
        "each rank runs eager steps with DDP's overlapped all-reduce"
    )


def on_failure(error: BaseException, run: Any) -> Any:
    """Every rank: leave its error in the store. Rank 0: the error naming the rank(s), and tags on the run.

    Returns `error` itself when there is nothing to add (a single process, a plain stop).
    """
    global _failing
    if _ctx is None:
        return error
    _failing = True
    try:  # the agent's SIGTERM must not cut the record short (whoever's handler is installed now)
        signal.signal(signal.SIGTERM, _on_term)
    except ValueError:
        pass  # not the main thread
    report_failure(error)
    if not _ctx.main:
        return error
    explained = explain(error)
    if isinstance(explained, RankFailed):
        try:
            run.set_tags({"distributed.failed_ranks": ",".join(map(str, explained.ranks)) or "unknown"})
        except Exception:
            pass
    return explained  # type: ignore[return-value]


GRAPH_MIXING = "NCCL_GRAPH_MIXING_SUPPORT"


def nccl_defaults(env: Any = None) -> dict[str, str]:
    """NCCL settings this job's pattern allows, set before the communicator exists; a user's own value wins.

    `NCCL_GRAPH_MIXING_SUPPORT=0`: NCCL then skips the ordering it adds to every captured
    collective so that graphs and eager collectives may be in flight at once. Here they
    never are: the eager ones (the epoch's sums, the buffers' broadcast, checkpoints' gathers)
    run after the device is synchronised, and the graphs' warm-up collectives precede the
    capture on the same streams. Measured on 2 H100s (resnet18 bf16, batch 256 per GPU, three
    runs each, docs/benchmarks.md): 1.935x one GPU against 1.924x, the median of each.
    Returns what it set (the graphs note reads the variable itself, whoever set it).
    """
    e = os.environ if env is None else env
    if GRAPH_MIXING in e:
        return {}
    e[GRAPH_MIXING] = "0"
    return {GRAPH_MIXING: "0"}


def init(ctx: Context, device: torch.device) -> str:
    """Join the process group (backend by device); install the SIGTERM handler that ends this rank cleanly."""
    global _ctx, _backend, _joined
    import torch.distributed as dist

    backend = backend_for(device.type)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            kwargs["device_id"] = device  # eager NCCL communicator on this rank's GPU
        if backend == "nccl":
            nccl_defaults()
        dist.init_process_group(
            backend, rank=ctx.rank, world_size=ctx.world_size, timeout=datetime.timedelta(seconds=timeout_s()), **kwargs
        )
    _ctx, _backend, _joined = ctx, backend, True
    import atexit

    atexit.register(shutdown)  # a backstop: the CLI ends a rank through train/ranks/teardown.py, which leaves first
    signal.signal(signal.SIGTERM, _on_term)  # the agent stops the survivors with SIGTERM when a rank dies
    return backend


_failing = False  # set once this rank is recording a failure: a second SIGTERM must not cut that short


def _on_term(signum: int, frame: Any) -> None:
    if _failing:
        return  # the agent waits (then SIGKILLs); finish writing the FAILED run first
    raise PeerFailed(f"rank {rank()} was stopped by the launcher (SIGTERM)")


def shutdown() -> None:
    """Leave the process group (idempotent).

    With gloo this does not stop the group's worker threads once DDP was built (its
    reducer keeps the group alive): see train/ranks/teardown.py for how a rank ends safely.
    """
    global _ctx, _backend
    import torch.distributed as dist

    from mpsrun.train.ranks import graph_sync

    graph_sync.reset()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    _ctx, _backend = None, None


def job_store() -> Any | None:
    """The job's c10d store (the rendezvous store every rank shares), or None outside a job."""
    return _store()


def _store() -> Any | None:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def report_failure(error: BaseException) -> None:
    """Leave this rank's error in the job's store, for rank 0 to name it (best effort, never raises)."""
    if _ctx is None or isinstance(error, (PeerFailed, KeyboardInterrupt)):
        return  # stopped, not failed: the cause is elsewhere
    store = _store()
    if store is None:
        return
    try:
        store.set(f"{FAILED_KEY}{_ctx.rank}", f"{type(error).__name__}: {error}"[:2000])
        store.add(FAILED_KEY + "count", 1)
    except Exception:
        pass


def failed_ranks(wait_s: float = 3.0) -> dict[int, str]:
    """{rank: error} that other ranks reported; waits briefly, since the failing rank may still be writing."""
    if _ctx is None:
        return {}
    store = _store()
    if store is None:
        return {}
    import time

    found: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    while True:
        for r in range(_ctx.world_size):
            if r in found:
                continue
            try:
                if store.check([f"{FAILED_KEY}{r}"]):
                    found[r] = store.get(f"{FAILED_KEY}{r}").decode(errors="replace")
            except Exception:
                return found
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def explain(error: BaseException) -> BaseException:
    """On rank 0 of a job: the error to record, naming the rank that brought the job down.

    A signal (KeyboardInterrupt) with no rank reporting a failure is returned as is: a stop, not a failure.
    """
    if _ctx is None:
        return error
    wait = 3.0 if isinstance(error, (PeerFailed, RuntimeError, KeyboardInterrupt)) else 0.5
    peers = {r: m for r, m in failed_ranks(wait).items() if r != _ctx.rank}
    if peers:
        named = "; ".join(f"rank {r} failed: {m}" for r, m in sorted(peers.items()))
        return RankFailed(named, sorted(peers), error)
    if isinstance(error, KeyboardInterrupt):
        return error
    if isinstance(error, PeerFailed):
        return RankFailed(
            f"{error}; no rank reported an error: a rank was killed (e.g. out of memory, SIGKILL) or the job was stopped",
            [],
            error,
        )
    return RankFailed(f"rank {_ctx.rank} failed: {type(error).__name__}: {error}", [_ctx.rank], error)


class RankFailed(Exception):
    """A distributed job's failure, with the rank(s) to blame (the run's `distributed.failed_ranks` tag)."""

    def __init__(self, message: str, ranks: list[int], cause: BaseException) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.__cause__ = cause


# ----------------------------------------------------------------------------- reductions


def reduce_sums(*tensors: torch.Tensor) -> None:
    """Sum each tensor over all ranks, in place, in one collective (loss sums, correct counts, sample counts).

    Sums, not means: a metric over the whole validation set is (sum of sums) / (sum of
    counts), exact whatever each rank's share. float64 keeps int64 counts exact.
    A no-op in a single process.
    """
    if _ctx is None or not tensors:
        return
    import torch.distributed as dist

    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])  # vectors too (regression sums)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    i = 0
    for t in tensors:
        t.copy_(flat[i : i + t.numel()].view(t.shape).to(t.dtype))
        i += t.numel()


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank ([obj] in a single process)."""
    if _ctx is None:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * _ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (a resumed job's checkpoint: rank 0 fetched it); `obj` in a single process."""
    if _ctx is None:
        return obj
    import torch.distributed as dist

    box = [obj if _ctx.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# ----------------------------------------------------------------------------- the model


def wrap(model: nn.Module, device: torch.device, graphs: bool = False) -> nn.Module:
    """DistributedDataParallel around the model (same parameters: optimizers built before or after agree);
    with CUDA graphs on NCCL, the plain module and an all-reduce the captured step issues itself."""
    if _ctx is None:
        return model
    if graphs and _backend == "nccl":
        from mpsrun.train.ranks import graph_sync

        return graph_sync.install(model, _ctx.world_size)
    from torch.nn.parallel import DistributedDataParallel as DDP

    if device.type == "cuda":
        return DDP(model, device_ids=[device.index], output_device=device.index)
    return DDP(model)


def no_sync(model: nn.Module, skip: bool) -> Any:
    """DDP's `no_sync()` when `skip` (an accumulation group's micro-batches before its last), else nothing.

    Gradients then add up locally and the last micro-batch's backward all-reduces their
    sum once: one all-reduce per optimizer step, and the same average gradient.
    """
    import contextlib

    if not skip or _ctx is None:
        return contextlib.nullcontext()
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = getattr(model, "_orig_mod", model)  # under torch.compile
    return ddp.no_sync() if isinstance(ddp, DDP) else contextlib.nullcontext()


def for_recording(setup: Any) -> None:
    """After training, on rank 0: the user's module (no DDP: its forward would wait for the other
    ranks) and the whole validation set, for what the run records at its end (figures, the model)."""
    if _ctx is None:
        return
    setup.model = unwrap(setup.model)
    whole = getattr(setup.plan.val, "whole", None)
    if whole is not None:
        import dataclasses

        setup.plan = dataclasses.replace(setup.plan, val=whole)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under torch.compile and DDP: stable state_dict keys for weights and checkpoints."""
    model = getattr(model, "_orig_mod", model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return model.module if isinstance(model, DDP) else model
