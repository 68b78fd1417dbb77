"""A long-lived worker: asks the study for trials and trains them in this process until the budget is met.

torch is imported once per worker and the dataset built once (trial.DataCache); a trial
costs a model, an optimizer and an MLflow child run, not a Python start. `mpsrun sweep
--workers N` runs worker 0 in its own process and N-1 more as `python -m
mpsrun.sweep.worker` (each in its own session: the command forwards a signal once). The
extra workers are started first thing, before the command has a study or a parent run, and
load torch, their MLflow helper and the data meanwhile; they read the rest of the job (the
parent run) from their stdin when it exists (`late_job`): started after those, they began
their first trial about 10 s after worker 0 on the H100.
The ask/tell loop, rather than `study.optimize`, is what lets the budget count only
trials that ended by their own doing, and a lost trial be failed and queued again.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from mpsrun.recipe.load import Resolved
from mpsrun.sweep import space, storage

if TYPE_CHECKING:
    from mpsrun.sweep.trial import Outcome

_T0 = time.perf_counter()


@dataclass
class Job:
    """What every worker of one sweep needs; sent to extra workers as JSON."""

    recipe: str
    overrides: list[str]
    storage_url: str
    study: str
    tracking_uri: str | None
    parent_run_id: str
    target: int
    workers: int = 1
    started_after: int = 0  # trials in the study when this command started (seeds the samplers apart)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> "Job":
        return cls(**json.loads(text))


@dataclass
class TrialEnd:
    number: int
    outcome: "Outcome"
    values: dict[str, Any]
    seconds: float


@dataclass
class Tally:
    ran: list[TrialEnd] = field(default_factory=list)
    said: Any = None  # fused.work.Said: what the fused groups said (group size, trials run unfused and why)


def share_cores(workers: int) -> None:
    """N workers on one CPU or one GPU: torch's threads divided so they do not oversubscribe the cores."""
    if workers > 1:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // workers))


def device_for(resolved: Resolved, index: int, workers: int) -> dict[str, Any]:
    """With several GPUs each worker takes its own (cuda:i); otherwise the recipe's device, shared."""
    if workers <= 1 or resolved.recipe.device not in ("auto", "cuda"):
        return {}
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"device": f"cuda:{index % n}"} if n > 1 else {}


def placement(resolved: Resolved, index: int, workers: int) -> dict[str, Any]:
    """What every trial of worker `index` adds to its values: the trial defaults and its device."""
    return {**trial_defaults(resolved), **device_for(resolved, index, workers)}


def trial_defaults(resolved: Resolved) -> dict[str, Any]:
    """What a trial skips unless the recipe asks for it: the logged model, its figures, system metrics, epoch checkpoints.

    Seconds a trial on a small model (mlflow.pytorch's export alone is ~3 s on 2 cores), and
    nothing the search needs: `mpsrun run best_recipe.yaml` trains (and logs) the best one.
    Each skip is tagged on the trial's run (`mpsrun.model_artifact`), as `mpsrun run` does.
    """
    data = resolved.source.data
    out: dict[str, Any] = {}
    tracking = data.get("tracking") or {}
    if "log_model" not in tracking:
        out["tracking.log_model"] = False
    if "figures" not in tracking:  # the parent draws the sweep's figures
        out["tracking.figures"] = False
    if "system_metrics" not in tracking:  # a monitor thread (and NVML) per trial of a second or two: one sample, if any
        out["tracking.system_metrics"] = False
    if "checkpoint" not in data:
        out["checkpoint.every"] = 0
    return out


def load_study(job: Job, resolved: Resolved, index: int, on_lost_run: Callable[[str, str], None]) -> Any:
    import optuna

    sweep = resolved.recipe.sweep
    assert sweep is not None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = storage.open_storage(job.storage_url, on_failed=lambda s, t: storage.lost_run(t, "worker lost (no heartbeat)", on_lost_run))
    return optuna.load_study(
        study_name=job.study, storage=st,
        sampler=space.sampler(sweep, space.worker_seed(resolved.recipe.seed, index, job.started_after)),
        pruner=space.pruner(sweep, resolved.recipe.epochs),
    )


def start_tracker(resolved: Resolved, tracking_uri: str | None) -> Any:
    """This worker's MLflow helper process, for all its trials (as `mpsrun run` has one for its run).

    The trials' MLflow writes and records run there, on another core, beside the training. Its set-up
    (importing mlflow, opening the store) took 6-11 s on the H100 machine with four workers starting at
    once, so the launching command starts worker 0's first thing, before its study and parent run.
    """
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.track.helper import background
    from mpsrun.track.store import client as store

    uri, artifact_root = store.resolve_uri(tracking_uri)
    experiment = resolved.recipe.tracking.experiment or resolved.path.stem
    trials = trial_recipe(resolved, trial_defaults(resolved)).recipe.tracking  # what every trial's run records
    ends_light = not trials.log_model and not trials.figures  # the trials' default
    return background.start(uri, experiment, artifact_root, device=resolved.recipe.device, keep_open=True,
                            warm="begin" if ends_light else None)


def work(job: Job, resolved: Resolved, index: int, on_end: Callable[[TrialEnd, Any], None] | None = None,
         ready: Callable[[], None] | None = None, late: Callable[[], Job | None] | None = None, tracker: Any = None,
         keep_tracker: bool = False) -> Tally:
    """Trials until the study holds `job.target` counted trials (or none is left to ask for).

    `ready` is called once torch, the study and the first dataset are loaded, before the first trial.
    `late`, when given, is called once torch and the data are loaded and returns the whole job (the parent
    run known), or None when the command ended before it had one: the worker then ends without a trial.
    Each worker starts asking as soon as it is ready, not once all are: on one GPU the workers gain
    only by overlapping one's CPU work with another's epochs, and waiting for the slowest start
    (torch, mlflow and the data in each) left the GPU idle meanwhile. `on_end` is called after each trial.
    `tracker`: a helper started earlier (start_tracker); this worker closes it when it ends, unless `keep_tracker`
    (the launching command writes the parent's results through it afterwards: parent.Via).
    """
    from mpsrun.train import warm as warming  # no torch at import

    # torch's optimizers import torch._dynamo when built: every worker's first trial paid it (2.5 s on the
    # 2-core machine, seconds more on the H100 one); on a thread it overlaps the study's and the data's load.
    # Not where trials fuse: a fused group builds no torch.optim optimizer (sweep/fused/optim.py), and the import
    # would only hold the interpreter while the group trains (a trial that runs unfused imports it when built)
    fusing = resolved.recipe.sweep is not None and resolved.recipe.sweep.fuse != "off"
    warm = None if fusing else warming.dynamo()
    if tracker is None:
        tracker = start_tracker(resolved, job.tracking_uri)
    import torch

    threads = torch.get_num_threads()
    try:
        return _work(job, resolved, index, on_end, ready, tracker, warm, late)
    finally:
        torch.set_num_threads(threads)  # a worker in a longer-lived process (tests, notebooks) gives them back
        if not keep_tracker:
            tracker.close()


def _work(job: Job, resolved: Resolved, index: int, on_end: Callable[[TrialEnd, Any], None] | None, ready: Callable[[], None] | None, tracker: Any,
          warm: Any = None, late: Callable[[], Job | None] | None = None) -> Tally:
    from mpsrun.devices import canary
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep import head, parent, trace
    from mpsrun.sweep import trial as trial_mod  # torch: imported here, once per worker

    start = {"imports": time.perf_counter() - _T0}  # the worker's start, lap by lap (MPSRUN_SWEEP_TRACE's total line)
    canary.REUSE_OPS = True  # the fixed operations checked once per device in this worker; each trial's model still is
    share_cores(job.workers)
    where = placement(resolved, index, job.workers)
    marker = parent.RunMarker(job.tracking_uri, tracker, parent.Via(tracker) if hasattr(tracker, "hook_later") else None)
    cache = head.take(where)  # worker 0: built on the command's thread while the study and the parent run opened
    start["head"] = time.perf_counter() - _T0 - sum(start.values())  # worker 0's wait for that thread (its rehearsal)
    if cache is None:
        cache = trial_mod.DataCache()
        try:
            cache.get(trial_recipe(resolved, where))  # the data every trial of this recipe's dataset section uses
        except Exception:  # noqa: BLE001 - the first trial meets it again and says why (bad input: exit 2)
            pass
    start["data"] = time.perf_counter() - _T0 - sum(start.values())
    if warm is not None:
        warm.join(60)  # the first trial would wait for the same import
    start["warm"] = time.perf_counter() - _T0 - sum(start.values())
    if late is not None:
        whole = late()
        if whole is None:
            return Tally()  # the command ended (bad input, a signal) before it had a study and a parent run
        job = whole
    study = load_study(job, resolved, index, marker.lost)
    start["study"] = time.perf_counter() - _T0 - sum(start.values())
    if ready is not None:
        ready()
    if late is not None:
        wait_go()  # MPSRUN_SWEEP_TOGETHER: until every worker is ready (drive.ENV_TOGETHER); else its stdin has ended already
    tracing = trace.enabled()
    totals = trace.Totals(index) if tracing else None
    ready_s = time.perf_counter() - _T0  # this module's import to the first ask: the worker's start
    tally = Tally()
    if resolved.recipe.sweep is not None and resolved.recipe.sweep.fuse != "off":
        from mpsrun.sweep.fused.work import Said

        tally.said = Said()
    ended = False
    try:
        _loop(job, resolved, index, on_end, tracker, study, marker, cache, where, tally, totals)
        ended = True
    finally:
        canary.REUSE_OPS = False
        if totals is not None:
            totals.emit(ready_s, start)
        # On the parent, once: what an extra worker's fusing did and did not do (worker 0's, when it ends, the launching
        # command shows and writes in the parent's notes: drive.run), or worker 0's when it was stopped
        if (index > 0 or not ended) and tally.said is not None and tally.said.all():
            from mpsrun.train.record import hook_later

            try:
                hook_later(tracker, "tag_run", job.parent_run_id, {f"mpsrun.sweep.fuse.{index}": " | ".join(tally.said.all())[:5000]})
            except Exception:  # noqa: BLE001 - said on screen by worker 0 regardless
                pass
    return tally


def _loop(job: Job, resolved: Resolved, index: int, on_end: Callable[[TrialEnd, Any], None] | None, tracker: Any, study: Any,
          marker: Any, cache: Any, placement: dict[str, Any], tally: Tally, totals: Any) -> None:
    from mpsrun.sweep import trace

    sweep = resolved.recipe.sweep
    assert sweep is not None
    if sweep.fuse != "off":  # trials that differ only in values train as one fused step (sweep/fused/)
        from mpsrun.sweep.fused import work as fused

        def run_one(t: Any, values: dict[str, Any]) -> None:
            _one(job, resolved, on_end, tracker, study, marker, cache, placement, tally, None, None, t, values, time.perf_counter())

        def finish(t: Any, outcome: "Outcome", values: dict[str, Any], start: float) -> None:
            _finish(study, t, outcome, values, start, marker, tally, on_end, tagged=True)  # a member's state: with its run's end

        fused.loop(job, resolved, index, tracker, study, marker, cache, placement, run_one, finish, tally.said)
        return
    while True:
        phases = trace.Phases() if totals is not None else None
        wait0 = getattr(tracker, "wait_s", 0.0)
        storage.reap(study, lambda t, why: storage.lost_run(t, f"its worker died ({why})", marker.lost))
        done, running = storage.budget(study, job.target)
        if done + running >= job.target:
            break
        t = storage.ask(study, job.target)
        if t is None:  # another worker took the last place at the same moment
            break
        if phases is not None:
            phases.lap("ask")
        _one(job, resolved, on_end, tracker, study, marker, cache, placement, tally, totals, phases, t, None, time.perf_counter(), wait0)


def _one(job: Job, resolved: Resolved, on_end: Callable[[TrialEnd, Any], None] | None, tracker: Any, study: Any, marker: Any, cache: Any,
         placement: dict[str, Any], tally: Tally, totals: Any, phases: Any, t: Any, values: dict[str, Any] | None, start: float,
         wait0: float = 0.0) -> None:
    """One trial, unfused, in this process: trained through the runner, told, its line shown. `values`: already suggested."""
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep import trial as trial_mod

    sweep = resolved.recipe.sweep
    assert sweep is not None
    beat = storage.heartbeat_thread(study, t._trial_id)  # noqa: SLF001
    outcome: Any = None
    try:
        values = space.suggest(t, sweep) if values is None else values
        trial_resolved = trial_recipe(resolved, {**values, **placement})
        outcome = trial_mod.run(trial_resolved, t, sweep.metric, sweep.pruner, job.parent_run_id, job.tracking_uri, cache,
                                trial_mod.trial_tags(job.study, t, values), tracker=tracker, phases=phases)
    except KeyboardInterrupt as e:
        storage.mark_lost(study, t, f"interrupted ({getattr(e, 'name', 'SIGINT')})")
        _lost_run_after(t, marker, f"interrupted ({getattr(e, 'name', 'SIGINT')})")
        raise
    except trial_mod.BadInput:
        storage.fail_bad_input(study, t)
        raise
    except Exception as e:  # noqa: BLE001 - a combination the recipe rejects: this trial fails, the sweep goes on
        outcome = trial_mod.Outcome("FAILED", None, None, f"{type(e).__name__}: {e}")
    finally:
        beat.join()
    _finish(study, t, outcome, values or {}, start, marker, tally, on_end, phases)
    if phases is not None and totals is not None:
        phases.lap("report")
        phases.add("wait", getattr(tracker, "wait_s", 0.0) - wait0)
        totals.add(phases, t.number)


def _finish(study: Any, t: Any, outcome: "Outcome", values: dict[str, Any], start: float, marker: Any, tally: Tally,
            on_end: Callable[[TrialEnd, Any], None] | None, phases: Any = None, tagged: bool = False) -> None:
    """A trial's end: the study told, its run's state tagged (unless `tagged`: a fused member's went with its run's end,
    fused/record.end), its line shown."""
    _tell(study, t, outcome)
    if outcome.run_id and not tagged:
        marker.state(outcome.run_id, outcome.state)
    if phases is not None:
        phases.lap("tell")
    end = TrialEnd(t.number, outcome, values, time.perf_counter() - start)
    tally.ran.append(end)
    if on_end is not None:
        on_end(end, study)


def _lost_run_after(t: Any, marker: Any, why: str) -> None:
    run_id = t.user_attrs.get(storage.RUN_ID) if hasattr(t, "user_attrs") else None
    if run_id:
        marker.state(run_id, "FAILED", counted=False, why=why)


def _tell(study: Any, t: Any, outcome: "Outcome") -> None:
    from optuna.trial import TrialState

    if outcome.run_id:
        t.set_user_attr(storage.RUN_ID, outcome.run_id)
    if outcome.message:
        t.set_user_attr("mpsrun.message", outcome.message[:2000])
    if outcome.state == "COMPLETE":
        study.tell(t, outcome.value)
    elif outcome.state == "PRUNED":
        study.tell(t, state=TrialState.PRUNED)
    else:
        study.tell(t, state=TrialState.FAIL)


def end_to_json(end: TrialEnd) -> str:
    o = end.outcome
    return json.dumps({"number": end.number, "state": o.state, "value": o.value, "run_id": o.run_id, "message": o.message[:1000],
                       "values": end.values, "seconds": end.seconds}, default=str)


def end_from_json(text: str) -> TrialEnd:
    from mpsrun.sweep.trial import Outcome

    d = json.loads(text)
    return TrialEnd(int(d["number"]), Outcome(d["state"], d["value"], d["run_id"], d["message"]), d["values"], float(d["seconds"]))


READY = b"ready"  # an extra worker's first line to the command that started it


def _write(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)  # one write of less than PIPE_BUF bytes: never interleaved with another
    except OSError:  # the command is gone (killed): the trial is in the study and MLflow regardless
        pass


def report_to(fd: int) -> Callable[[TrialEnd, Any], None]:
    """An extra worker's `on_end`: each trial's end as a JSON line to the command that started it, which shows it."""
    def on_end(end: TrialEnd, study: Any) -> None:
        _write(fd, (end_to_json(end) + "\n").encode())
    return on_end


LATE = "--job-on-stdin"  # the job's argument lacks the parent run: the whole job comes as one line on stdin


def late_job() -> Job | None:
    """The whole job, one JSON line the command writes once its study and parent run exist; None at end of input."""
    line = sys.stdin.readline()
    return Job.from_json(line) if line.strip() else None


def wait_go() -> None:
    """Until the end of stdin: at once, unless the command holds its workers until all are ready (drive.Early.go)."""
    try:
        sys.stdin.read()
    except (OSError, ValueError):  # no stdin (a worker started by hand): nothing to wait for
        pass


def main(argv: list[str] | None = None) -> int:
    """`python -m mpsrun.sweep.worker INDEX JOB_JSON [REPORT_FD] [--job-on-stdin]`: one extra worker of `mpsrun sweep --workers N`."""
    from mpsrun.exitcodes import EXIT_INPUT, EXIT_OK
    from mpsrun.plugins import resolve
    from mpsrun.sweep import trial as trial_mod
    from mpsrun.train.keep import interrupt

    args = sys.argv[1:] if argv is None else argv
    later = LATE in args
    args = [a for a in args if a != LATE]
    index, job = int(args[0]), Job.from_json(args[1])
    report_fd = int(args[2]) if len(args) > 2 else None
    resolved = resolve(job.recipe, job.overrides)
    try:
        with interrupt.stop_on_signals():
            work(job, resolved, index, on_end=report_to(report_fd) if report_fd is not None else None,
                 ready=(lambda: _write(report_fd, READY + b"\n")) if report_fd is not None else None,
                 late=late_job if later else None)
    except KeyboardInterrupt as e:
        return interrupt.exit_code(e)
    except trial_mod.BadInput as e:
        sys.stderr.write(f"error: {e}\n")
        return EXIT_INPUT
    return EXIT_OK


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no module-by-module teardown of torch (see cli._end); every record is written
