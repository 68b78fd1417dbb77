"""End-of-epoch checkpoints, as a callback: everything needed to continue a run exactly.

A checkpoint holds the model and optimizer state, every `RunState.extras` object
that has a `state_dict()` (LR scheduler, grad scaler), the other callbacks' state
(early stopping's best and patience), the epoch counter, the metric history, the
random generators (python, numpy, torch CPU and device) and how the data order is
made (a pure function of seed and epoch, see `train.data.epoch_seed`).

Why it is built this way:
- Off the timed path: on the training thread the state is only copied to the host
  (the engine has already synchronised at the epoch end); a background thread
  pickles, writes and uploads. Both costs are recorded per epoch (`checkpoint_copy_s`,
  `checkpoint_time_s` in the run's `mpsrun_timings.json`), so "free" can be checked.
- Atomic: a file is written under a temporary name and renamed, so a checkpoint
  that exists is whole; the upload into a local artifact store does the same.
- Durable in order: before an epoch's checkpoint is uploaded, the tracker writes
  every buffered metric (`sync`), so a resumable epoch always has its metrics.
- With the run: files go to the run's artifacts (`checkpoints/last.pt`,
  `checkpoints/best.pt`), so a run on a shared server resumes from any machine.
- Never a dead end: each file is verified whole before it replaces anything, and the
  previous `last.pt` is kept as `prev.pt` until the new one is up (a rename in a local
  store, an upload first elsewhere); resume falls back to the newest readable one.
"""

from __future__ import annotations

import copy
import math
import os
import queue
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from mpsrun.recipe.model import CheckpointSection
from mpsrun.track.store.runs import whole
from mpsrun.train.ranks import distributed
from mpsrun.train.controls.callbacks import Callback, RunState

FORMAT = 1
LAST, BEST, PREV = "last.pt", "best.pt", "prev.pt"  # prev: the last one before, kept until a new last is written and verified

Upload = Callable[[Path, str], None]  # (local file, name inside the run's checkpoints/ folder)
Remove = Callable[[str], bool]  # delete checkpoints/NAME from the run's artifacts; False where the store cannot
Rotate = Callable[[str, str], bool]  # keep checkpoints/NAME as another name before a new one is put; False where the store cannot


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose state_dict has stable key names (torch.compile wraps it as `_orig_mod`, DDP as `module`)."""
    from mpsrun.train.ranks.distributed import unwrap as unwrap_all

    return unwrap_all(model)


def to_host(obj: Any) -> Any:
    """A deep copy with every tensor on the CPU: the training goes on changing the originals in place."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return copy.deepcopy(obj)


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    elif device.type == "mps":
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    elif device.type == "mps" and "mps" in state:
        torch.mps.set_rng_state(state["mps"])


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint file (ours: plain containers, tensors and numpy RNG state)."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise ValueError(f"{path} is not a readable mpsrun checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise ValueError(f"{path} is not an mpsrun checkpoint of format {FORMAT}")
    return ck


def _write_atomic(obj: dict[str, Any], target: Path) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    if not whole(tmp):  # verified before it replaces anything (a full disk leaves a short file)
        tmp.unlink(missing_ok=True)
        raise OSError(f"{target.name} was not written whole")
    os.replace(tmp, target)


def _copy_atomic(src: Path, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, target)


@dataclass
class _Job:
    epoch: int
    state: dict[str, Any]
    names: list[str]  # LAST, BEST, epoch-NNNN.pt: which files this state becomes
    copy_s: float


@dataclass
class Checkpointer(Callback):
    """Writes checkpoints at epoch ends and restores one at fit start (for `mpsrun resume`).

    Put it after every other callback: their state for the epoch is then final
    when it is saved, and on resume it restores them last.
    """

    spec: CheckpointSection
    seed: int
    upload: Upload | None = None
    remove: Remove | None = None
    rotate: Rotate | None = None  # last.pt -> prev.pt in the store before a new last.pt goes up
    sync: Callable[[], Any] | None = None  # the tracker's: buffered metrics written before an upload
    note: Callable[[str], None] = lambda m: None
    meta: dict[str, str] = field(default_factory=dict)  # mpsrun version, plugins: compared on resume
    restore: dict[str, Any] | None = None  # a loaded checkpoint to continue from
    best_file: Path | None = None  # the best checkpoint of a resumed run, when it was not this session's
    siblings: Callable[[], Callback] | None = None  # the Callbacks holding every callback's state
    hyper: dict[str, Any] = field(default_factory=dict)  # optimizer settings overridden on resume: win over the saved ones
    ranks_rng: bool = True  # DDP: gather every rank's random state at epoch ends (False: the job writes no checkpoints)
    directory: Path | None = None  # the local copies' folder, made with the first checkpoint (`_dir`)
    best: float | None = None
    best_epoch: int | None = None
    last_epoch: int | None = None  # of the newest durable checkpoint
    copy_time_s: float = 0.0
    write_time_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    epoch_times: list[dict[str, float]] = field(default_factory=list)  # per written checkpoint: epoch, write and copy seconds

    def __post_init__(self) -> None:
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=2)  # bounded: never more than two host copies
        self._thread: threading.Thread | None = None
        self._best_model: dict[str, Any] | None = None  # host copy of the best weights of this session
        self._uploaded: list[str] = []  # epoch-NNNN.pt names, oldest first (for keep)
        self._log: Any = None  # the run's log (RunState.log), for per-epoch times and the last-checkpoint tag
        self._rank_rngs: list[dict[str, Any]] | None = None  # every rank's random state at this epoch's end (DDP)

    @property
    def enabled(self) -> bool:
        return self.spec.every > 0

    # -- callback hooks
    def on_fit_start(self, run: RunState) -> None:
        self._log = run.log
        if self.restore is not None:
            self._apply(run, self.restore)
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._work, name="mpsrun-checkpoint", daemon=True)
            self._thread.start()

    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
        if self.ranks_rng and distributed.world_size() > 1:  # every rank, every epoch (one collective, the same on all): each rank's own
            self._rank_rngs = distributed.gather(rng_state(run.device))  # random state, for rank 0's checkpoint
        if not self.enabled:
            return
        improved = self._better(metrics.get(self.spec.monitor), epoch)
        last = epoch + 1 >= run.epochs or run.should_stop
        due = (epoch + 1) % self.spec.every == 0 or last
        names = ([LAST] if due else []) + ([BEST] if improved else [])
        if due and self.spec.keep > 1:
            names.append(f"epoch-{epoch:04d}.pt")
        if not names:
            return
        t = time.perf_counter()
        state = self.snapshot(run, epoch)
        spent = time.perf_counter() - t
        if improved:
            self._best_model = state["model"]
        t = time.perf_counter()
        self._queue.put(_Job(epoch, state, names, spent))  # waits only while two writes are queued
        self.copy_time_s += spent + time.perf_counter() - t

    def on_fit_end(self, run: RunState) -> None:
        self.wait()

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch = state.get("best"), state.get("best_epoch")

    # -- what a checkpoint is
    def snapshot(self, run: RunState, epoch: int) -> dict[str, Any]:
        extras = {k: v.state_dict() for k, v in run.extras.items() if callable(getattr(v, "state_dict", None))}
        others = self.siblings().state_dict() if self.siblings is not None else {}
        return to_host(
            {
                "format": FORMAT,
                "epoch": epoch,  # the last finished epoch (0-based, = its MLflow step)
                "epochs": run.epochs,
                "model": unwrap(run.model).state_dict(),
                "optimizer": run.optimizer.state_dict(),
                "extras": extras,
                "callbacks": others,
                "history": run.history,
                "rng": rng_state(run.device),
                "rng_ranks": self._rank_rngs,  # DDP: rank r resumes from its own state (None in one process)
                "data_order": {"kind": "epoch_seed", "seed": self.seed},
                "monitor": {"name": self.spec.monitor, "mode": self.spec.mode, "best": self.best, "best_epoch": self.best_epoch},
                "meta": self.meta,
            }
        )

    def _apply(self, run: RunState, ck: dict[str, Any]) -> None:
        unwrap(run.model).load_state_dict(ck["model"])
        run.optimizer.load_state_dict(ck["optimizer"])
        for key, value in self.hyper.items():  # `mpsrun resume ID optimizer.lr=0.01`: the new value, not the saved one
            for group in run.optimizer.param_groups:
                if key in group:
                    group[key] = value
            self.note(f"resume: optimizer.{key} = {value} replaces the checkpoint's value")
        for name, saved in ck.get("extras", {}).items():
            obj = run.extras.get(name)
            if obj is not None and callable(getattr(obj, "load_state_dict", None)):
                obj.load_state_dict(saved)
            else:
                self.note(f"resume: the checkpoint holds '{name}' state but this run has no '{name}'; not restored")
        if self.siblings is not None:
            self.siblings().load_state_dict(ck.get("callbacks", {}))  # this one's best included
        run.history[:] = list(ck.get("history", []))
        self.last_epoch = ck["epoch"]
        set_rng_state(self._own_rng(ck), run.device)  # last: nothing may draw between here and the first step

    def _own_rng(self, ck: dict[str, Any]) -> dict[str, Any]:
        """This rank's random state from the checkpoint: its own where the job had as many ranks, else rank 0's."""
        ranks = ck.get("rng_ranks")
        world = distributed.world_size()
        if ranks and len(ranks) == world:
            return ranks[distributed.rank()]
        if world > 1 and distributed.is_main_process():
            why = f"it was written by {len(ranks)} ranks" if ranks else "it holds one process's random state"
            self.note(f"resume: every rank continues from rank 0's random state ({why}; {world} ranks now): "
                      "dropout and other random draws differ from an uninterrupted job")
        return ck["rng"]

    def _better(self, value: float | None, epoch: int) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if self.best is None or (value < self.best if self.spec.mode == "min" else value > self.best):
            self.best, self.best_epoch = float(value), epoch
            return True
        return False

    # -- the writer thread
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception as e:  # noqa: BLE001 - training goes on; said at the end and tagged
                msg = f"checkpoint of epoch {job.epoch if job else '?'} failed: {type(e).__name__}: {e}"
                self.errors.append(msg)
                self.note(msg)
            finally:
                self._queue.task_done()

    def _write(self, job: _Job) -> None:
        t = time.perf_counter()
        first = self._dir() / job.names[0]
        prev = LAST in job.names and (self._dir() / LAST).is_file()
        if prev:  # this session's previous last.pt, verified when written: kept until the new one is up
            os.replace(self.directory / LAST, self.directory / PREV)
        _write_atomic(job.state, first)
        for name in job.names[1:]:
            _copy_atomic(first, self.directory / name)
        if self.sync is not None:
            self.sync()  # this epoch's metrics are durable before its checkpoint is
        if self.upload is not None:
            if LAST in job.names and not (self.rotate is not None and self.rotate(LAST, PREV)) and prev:
                self.upload(self.directory / PREV, PREV)  # a store that cannot rename: this session's copy goes up first
            for name in job.names:
                self.upload(self.directory / name, name)
        if LAST in job.names:
            self.last_epoch = job.epoch
        for name in job.names:
            if name.startswith("epoch-"):
                self._uploaded.append(name)
        self._prune()
        spent = time.perf_counter() - t
        self.write_time_s += spent
        # Per-epoch times go to the run's mpsrun_timings.json (`metrics`), not to MLflow metrics:
        # the UI's "Model metrics" opens with the user's training curves, not mpsrun's bookkeeping.
        self.epoch_times.append({"epoch": job.epoch, "checkpoint_time_s": spent, "checkpoint_copy_s": job.copy_s})
        if self._log is not None:
            if LAST in job.names:
                self._log.set_tags({"mpsrun.checkpoint.epoch": str(job.epoch)})

    def _prune(self) -> None:
        while len(self._uploaded) > self.spec.keep:
            old = self._uploaded.pop(0)
            (self._dir() / old).unlink(missing_ok=True)
            if self.remove is not None and not self.remove(old):
                self.note(f"checkpoint.keep: cannot delete checkpoints/{old} from this artifact store; it stays")

    def wait(self) -> None:
        """Block until every queued checkpoint is written and uploaded (fit end, interrupt)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Stop the writer and delete the local copies (the run's artifacts hold the checkpoints)."""
        self.wait()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self.directory is None:
            return
        if self.upload is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            try:
                self.directory.rmdir()  # only where it is empty: without an upload the local copies are the only ones
            except OSError:
                pass

    def _dir(self) -> Path:
        """The local copies' folder, made when the first checkpoint is written: a run (or a fused sweep's member,
        which builds a checkpointer and writes no checkpoint) that writes none leaves no empty folder behind."""
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="mpsrun-ckpt-"))
        return self.directory

    # -- the end of fit
    def best_weights(self) -> dict[str, Any] | None:
        """The best epoch's model weights (host copies), from this session or a resumed run's best.pt."""
        if self._best_model is not None:
            return self._best_model
        if self.best_file is not None and self.best_file.exists():
            return load(self.best_file)["model"]
        return None

    def metrics(self) -> dict[str, Any]:
        """This session's checkpoint bookkeeping, for the run's `mpsrun_timings.json`: totals, each epoch's times, the best."""
        out: dict[str, Any] = {"checkpoint_total_copy_s": self.copy_time_s, "checkpoint_total_time_s": self.write_time_s,
                               "checkpoint_epochs": list(self.epoch_times)}
        if self.best is not None:
            out["best"] = {"monitor": self.spec.monitor, "value": self.best, "epoch": int(self.best_epoch or 0)}
        return out
