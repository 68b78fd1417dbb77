"""What keeps a run from being lost, wired onto one run: liveness, the non-finite guard, checkpoints.

The runner calls this in four places (start, callbacks, after fit, interrupted) so
`runner.execute` stays a readable script and this concern lives in one file.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mpsrun.track.store import liveness, owner
from mpsrun.track.store.runs import PLANNED, RunFiles
from mpsrun.train.ranks import distributed
from mpsrun.train.controls.callbacks import Callback, Callbacks, RunState
from mpsrun.train.keep.checkpoint import Checkpointer
from mpsrun.train.keep.guard import NonFiniteGuard

META_KEYS = ("mpsrun.version", "plugin.model", "plugin.dataset")


@dataclass
class ResumePoint:
    """Where `mpsrun resume` continues: a run, its loaded checkpoint, its best file."""

    run_id: str
    checkpoint: dict[str, Any]
    best_file: Path | None = None
    overrides: list[str] = field(default_factory=list)
    world_size: int = 1  # the ranks the run trained on before (its `distributed.world_size` tag)
    landed: frozenset[int] = frozenset()  # epochs past the checkpoint whose metrics reached the store before the stop
    owner_base: int | None = None  # the newest owner claim on the run when it was planned (track/store/owner.py)
    source: str = ""  # which checkpoint file it continues from, and why that one (said on screen and tagged)

    @property
    def start_epoch(self) -> int:
        return int(self.checkpoint["epoch"]) + 1


class Continuity:
    """Liveness tags and heartbeat, the guard and the checkpointer of one run."""

    def __init__(self, setup: Any, tracker: Any, tags: dict[str, str], note: Callable[[str], None], resume: ResumePoint | None) -> None:
        recipe = setup.resolved.recipe
        self.tracker = tracker
        self.recipe = recipe
        self.note = note
        self.resume = resume
        self.bookkeeping: dict[str, Any] = {}  # the checkpointer's, once fit is over (after_fit)
        self.meta = {k: tags.get(k, "") for k in META_KEYS}
        self.guard = NonFiniteGuard(recipe.on_nonfinite, note)
        main = distributed.is_main_process()  # checkpoints and liveness: rank 0 of a DDP job alone
        ck_config = recipe.checkpoint if main else recipe.checkpoint.model_copy(update={"every": 0})
        # The run's artifact folder and uploads through the tracker: no MLflow client in this process.
        files = RunFiles(tracker.uri, tracker.run_id, getattr(tracker, "artifact_uri", None), tracker.log_file) if ck_config.every > 0 else None
        self.checkpointer = Checkpointer(
            ck_config,
            recipe.seed,
            upload=files.put if files else None,
            remove=files.remove if files else None,
            rotate=files.rotate if files else None,
            sync=tracker.sync,
            note=note,
            meta=self.meta,
            restore=resume.checkpoint if resume else None,
            best_file=resume.best_file if resume else None,
            hyper=self._hyper(resume),
            ranks_rng=recipe.checkpoint.every > 0,  # rank 0 checkpoints: every rank hands it its random state
        )
        start = {**liveness.identity(), PLANNED: str(recipe.epochs), "mpsrun.recipe_dir": str(setup.resolved.path.resolve().parent)}
        if recipe.checkpoint.every == 0:
            start["mpsrun.checkpoint"] = "off (checkpoint.every: 0)"
        if resume is not None and main:
            start.update(self._resume_tags(resume))
        tracker.set_tags(start)
        self.heartbeat = liveness.Heartbeat(_Tags(tracker), tracker.run_id).start() if main else None
        self.claim: int | None = None  # this process's owner claim on the run (track/store/owner.py), let go of at close

    def _hyper(self, resume: ResumePoint | None) -> dict[str, Any]:
        """Optimizer arguments given as overrides to `mpsrun resume`, with their validated values."""
        if resume is None:
            return {}
        keys = {o.split("=", 1)[0].removeprefix("optimizer.") for o in resume.overrides if o.startswith("optimizer.")}
        return {k: v for k, v in self.recipe.optimizer.kwargs.items() if k in keys and k != "name"}

    def _resume_tags(self, resume: ResumePoint) -> dict[str, str]:
        n = int(self.tracker.c.get_run(resume.run_id).data.tags.get("mpsrun.resumed", "0")) + 1
        tags = {
            "mpsrun.resumed": str(n),
            f"mpsrun.resume.{n}": f"from the checkpoint of epoch {resume.start_epoch - 1} (0-based) on {socket.gethostname()} "
            f"at {time.strftime('%Y-%m-%d %H:%M:%S')}; overrides: {' '.join(resume.overrides) or 'none'}"
            + (f"; world size {resume.world_size} -> {distributed.world_size()}" if resume.world_size != distributed.world_size() else ""),
        }
        tags[f"mpsrun.resume.{n}.checkpoint"] = resume.source or "checkpoints/last.pt"
        if resume.source:  # a fallback is said, never silent
            self.note(f"resume: {resume.source}")
        if resume.world_size != distributed.world_size():  # the job's tags say what trains now
            tags["distributed.world_size"] = str(distributed.world_size())
        old = resume.checkpoint.get("meta", {})
        changed = [f"{k}: {old.get(k)} -> {v}" for k, v in self.meta.items() if old.get(k) and old.get(k) != v]
        if changed:
            msg = "resume: code changed since the checkpoint (" + "; ".join(changed) + "); results may differ"
            self.note(msg)
            tags[f"mpsrun.resume.{n}.changed"] = msg
        return tags

    @property
    def start_epoch(self) -> int:
        return self.resume.start_epoch if self.resume else 0

    def callbacks(self, others: list[Callback]) -> Callbacks:
        """Guard first (a poisoned epoch is never saved), checkpointer last (it saves everyone's state)."""
        cbs = Callbacks(self.guard, *others, self.checkpointer)
        self.checkpointer.siblings = lambda: cbs
        return cbs

    def after_fit(self, state: RunState, model: Any) -> None:
        """Checkpoints written; with `model_from: best`, the best epoch's weights put back into the model."""
        ck = self.checkpointer
        ck.wait()
        self.bookkeeping = ck.metrics()  # into mpsrun_timings.json with the runner's own (train/runner.py)
        tags: dict[str, str] = {}
        if "best" in self.bookkeeping:  # what `mpsrun runs` shows as best (tags: the UI's Overview, not its charts)
            b = self.bookkeeping["best"]
            tags.update({"mpsrun.best.monitor": str(b["monitor"]), "mpsrun.best.value": f"{b['value']:.6g}", "mpsrun.best.epoch": str(b["epoch"])})
        if ck.errors:
            tags["mpsrun.checkpoint.errors"] = " | ".join(ck.errors)
        if self.recipe.model_from == "best":
            weights = ck.best_weights() if ck.enabled else None
            if weights is not None:
                from mpsrun.train.keep.checkpoint import unwrap

                unwrap(model).load_state_dict(weights)
                tags["mpsrun.model_from"] = f"best: epoch {ck.best_epoch} by {self.recipe.checkpoint.monitor} ({ck.best:.6g})"
            else:
                why = "checkpoints off" if not ck.enabled else f"no finite {self.recipe.checkpoint.monitor} was seen"
                tags["mpsrun.model_from"] = f"last epoch ({why}; model_from: best asked)"
                self.note(f"model_from: best: {why}; the last epoch's weights are used")
        else:
            tags["mpsrun.model_from"] = f"last: epoch {state.epoch}"
        self.tracker.set_tags(tags)

    def interrupted(self, e: BaseException, epoch: int) -> None:
        """A signal: let the queued checkpoint land, then say on the run what happened and how to go on."""
        self.checkpointer.wait()
        name = getattr(e, "name", "SIGINT")
        last = self.checkpointer.last_epoch
        where = f"last checkpoint: epoch {last}" if last is not None else "no checkpoint yet"
        when = f"after epoch {epoch} (0-based) ended" if last == epoch else f"during epoch {epoch} (0-based)"  # between two epochs
        self.tracker.set_tags({"mpsrun.interrupted": f"{name} {when}; {where}"})

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.checkpointer.close()
        if self.claim is not None:  # before the run's status is set: the next owner waits for both
            self.tracker.set_tags({owner.RELEASED: str(self.claim)})
            self.claim = None


class _Tags:
    """`client.set_tag` for the heartbeat, through the run's tracker (which may live in the MLflow helper)."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.tracker.set_tags({key: value})
