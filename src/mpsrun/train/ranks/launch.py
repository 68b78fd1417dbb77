"""`mpsrun run R --nproc N`: N ranks on this machine through torch's elastic launcher.

The launcher is the agent behind `torchrun` (torch.distributed.launcher.api), started
with the same choices as `torchrun --standalone --nproc-per-node N`: a c10d rendezvous
on a free local port, no restarts. Each rank is a plain `python -m mpsrun run R ...`
reading its rank from the environment, so `--nproc N` and `torchrun ... -m mpsrun run R`
are one code path.

What the launcher adds: checks that fail fast before any worker starts (the global batch
must split evenly; MPS has no multi-process backend; enough GPUs), and the last word on
the run when a rank dies: the agent stops the others and reports which rank failed and
how, and the launcher records that on rank 0's MLflow run (FAILED, or KILLED on a
signal), even when rank 0 itself was killed too hard to say anything.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mpsrun.train.ranks import distributed

from mpsrun.exitcodes import EXIT_FAIL, EXIT_INPUT, EXIT_INTERRUPT, EXIT_OK, EXIT_TERM  # noqa: F401


class LaunchInputError(Exception):
    """Bad input found before any worker started: exit 2."""


@dataclass
class Outcome:
    exit_code: int
    message: str | None = None
    run_id: str | None = None
    failed_ranks: list[int] = field(default_factory=list)


def precheck(device_request: str, fallback: list[str] | None, batch_size: int, nproc: int) -> str:
    """Raise LaunchInputError for a job that cannot run; returns the backend it will use."""
    if distributed.from_env() is not None:
        raise LaunchInputError("--nproc inside a job that a launcher (torchrun) already started; drop --nproc")
    if nproc < 1:
        raise LaunchInputError(f"--nproc must be at least 1, not {nproc}")
    problem = distributed.check_batch(batch_size, nproc)
    if problem:
        raise LaunchInputError(problem)
    from mpsrun.devices import resolve as devices

    try:
        choice = devices.resolve(device_request, fallback)
    except devices.DeviceUnavailable as e:
        raise LaunchInputError(str(e)) from None
    try:
        backend = distributed.backend_for(choice.device.type)
    except ValueError as e:
        raise LaunchInputError(str(e)) from None
    if choice.device.type == "cuda":
        import torch

        count = torch.cuda.device_count()
        if nproc > count:
            raise LaunchInputError(f"--nproc {nproc} needs {nproc} CUDA GPUs (one per rank); this machine has {count}")
    return backend


def launch(args: list[str], nproc: int, tracking_uri: str | None, command: str = "run", env: dict[str, str] | None = None) -> Outcome:
    """Start `python -m mpsrun <command> *args` as ranks 0..nproc-1 and wait; record a rank's death on the run.

    `command` is `run`, or `resume` (the same run continued by a job of nproc ranks);
    `env`: more variables the ranks inherit (the resume launcher's fetched files).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix="mpsrun-ddp-") as tmp:
        run_file = Path(tmp) / "run_id"
        extra = {distributed.ENV_RUN_FILE: str(run_file), **(env or {})}
        os.environ.update(extra)  # the workers inherit the launcher's environment
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=f"mpsrun-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",  # as torchrun --standalone: a free port on this machine
            max_restarts=0,
            monitor_interval=0.2,
            start_method="spawn",
        )
        try:
            elastic_launch(config, entrypoint=sys.executable)("-m", "mpsrun", command, *args)
        except ChildFailedError as e:
            out = _failed(e, run_file)
        except SignalException as e:
            code = EXIT_INTERRUPT if e.sigval == signal.SIGINT else EXIT_TERM
            out = Outcome(code, f"stopped by {signal.Signals(e.sigval).name}", _read(run_file))
            _mark(tracking_uri, out, "KILLED")
            return out
        except KeyboardInterrupt:
            out = Outcome(EXIT_INTERRUPT, "interrupted", _read(run_file))
            _mark(tracking_uri, out, "KILLED")
            return out
        else:
            return Outcome(EXIT_OK, None, _read(run_file))
        finally:
            for k in extra:
                os.environ.pop(k, None)
    if out.exit_code != EXIT_INPUT:
        _mark(tracking_uri, out, "FAILED")
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _failed(e: "Exception", run_file: Path) -> Outcome:
    failures = getattr(e, "failures", {}) or {}
    ranks = sorted(int(r) for r in failures)
    # The agent stops the survivors with SIGTERM; those are not the cause when another rank failed first.
    primary = [r for r in ranks if getattr(failures[r], "exitcode", None) != -signal.SIGTERM]
    ranks = primary or ranks
    parts = []
    codes = []
    for r in ranks:
        f = failures[r]
        code = getattr(f, "exitcode", None)
        codes.append(code)
        what = f"exit code {code}" if code is None or code >= 0 else f"signal {signal.Signals(-code).name}"
        parts.append(f"rank {r} (pid {getattr(f, 'pid', '?')}) failed with {what}")
    exit_code = EXIT_INPUT if codes and all(c == EXIT_INPUT for c in codes) else EXIT_FAIL
    return Outcome(exit_code, "; ".join(parts) or str(e), _read(run_file), ranks)


def _mark(tracking_uri: str | None, out: Outcome, status: str) -> None:
    """Record the launcher's view on rank 0's run: which rank failed, and the final status."""
    if out.run_id is None:
        return
    try:
        from mpsrun.track.store import client as tracking

        uri, _ = tracking.resolve_uri(tracking_uri)
        c = tracking.client(uri)
        run = c.get_run(out.run_id)
        tags = {"distributed.launcher_outcome": out.message or status}
        named = run.data.tags.get("distributed.failed_ranks")
        if named and named != "unknown":  # rank 0 read it from the job's store: the rank that failed first
            out.failed_ranks = [int(x) for x in named.split(",")]
            out.message = run.data.tags.get("mpsrun.error", out.message)
        elif out.failed_ranks:
            tags["distributed.failed_ranks"] = ",".join(map(str, out.failed_ranks))
        if "mpsrun.error" not in run.data.tags and status == "FAILED":
            tags["mpsrun.error"] = out.message or "a rank failed"
        for k, v in tags.items():
            c.set_tag(out.run_id, k, str(v)[:4900])
        if run.info.status != status and not (status == "FAILED" and run.info.status == "KILLED"):
            c.set_terminated(out.run_id, status)
    except Exception as err:  # the job's outcome stands; say why the run could not be updated
        out.message = f"{out.message}; could not update MLflow run {out.run_id}: {type(err).__name__}: {err}"
