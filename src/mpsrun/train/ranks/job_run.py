"""One MLflow run per data-parallel job: who writes it, and what it records about the ranks.

Rank 0 alone creates (or, resumed, continues) the run; the other ranks get
`NullTracker`, which takes the same calls and writes nothing, so the runner has one
code path. Every rank's device facts are gathered onto the run.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch

from mpsrun.train.ranks.distributed import ENV_RUN_FILE, backend, context, gather, is_main_process, rank


def rank_facts(device: torch.device, tags: dict[str, str]) -> dict[str, str]:
    """What one rank ran on, in a line per rank on the run (the full set is in distributed_ranks.json)."""
    facts = {"host": socket.gethostname(), "pid": str(os.getpid()), "device": str(device)}
    for k in ("cuda.device_name", "cuda.name", "cuda.uuid", "cpu.brand", "cpu.torch_threads", "sw.torch"):
        if k in tags:
            facts[k] = tags[k]
    return {"summary": facts, "all": tags}  # type: ignore[dict-item]


def job_tags(device: torch.device, device_tags: dict[str, str]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Collective: gathers every rank's device facts; returns (tags for the run, per-rank facts)."""
    ctx = context()
    if ctx is None:
        return {}, []
    facts = gather(rank_facts(device, device_tags))
    hosts = {f["summary"]["host"] for f in facts}
    tags = {
        "distributed.world_size": str(ctx.world_size),
        "distributed.backend": str(backend()),
        "distributed.nodes": str(max(ctx.nodes, len(hosts))),
        "distributed.local_world_size": str(ctx.local_world_size),
        "distributed.launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ and ENV_RUN_FILE not in os.environ else "mpsrun --nproc",
    }
    for r, f in enumerate(facts):
        tags[f"distributed.rank.{r}"] = " ".join(f"{k}={v}" for k, v in f["summary"].items())
    return tags, facts


def publish_run_id(run_id: str) -> None:
    """Rank 0 tells the `--nproc` launcher which run to mark if the job dies under it."""
    path = os.environ.get(ENV_RUN_FILE)
    if path and is_main_process():
        Path(path).write_text(run_id)


class NullTracker:
    """The tracker of ranks other than 0: the Tracker's calls, nothing written (ONE run per job)."""

    log_time_s = 0.0
    log_time_during_s = 0.0
    handoff_time_s = 0.0

    def __init__(self, uri: str, experiment: str, artifact_root: str | None = None) -> None:
        self.uri, self.experiment = uri, experiment
        self.run_id: str | None = None

    def start(self, run_name: str | None, tags: dict[str, str], parent_run_id: str | None = None) -> Any:
        from mpsrun.track.store.client import RunInfo

        return RunInfo(f"(rank 0's run; this is rank {rank()})", "", self.experiment, self.uri)

    def attach(self, run_id: str) -> Any:
        from mpsrun.track.store.client import RunInfo

        return RunInfo(run_id, "", self.experiment, self.uri)

    def flush(self) -> list[str]:
        return []

    def __getattr__(self, name: str) -> Any:  # log_params, log_metrics, set_tags, log_text, finish, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: None


def tracker(uri: str, experiment: str, artifact_root: str | None) -> Any:
    """The MLflow tracker on rank 0 (and in a single process); a NullTracker elsewhere."""
    if is_main_process():
        from mpsrun.track.store.client import Tracker

        return Tracker(uri, experiment, artifact_root)
    return NullTracker(uri, experiment, artifact_root)
