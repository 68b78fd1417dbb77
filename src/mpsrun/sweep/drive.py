"""`mpsrun sweep` from a resolved recipe to a finished study: checks, study, parent run, workers, results.

Bad input is found before anything heavy (`plan`): the section itself (Pydantic, in the
recipe wing), every value against the recipe and its plugins (`recipe.sweep.check_values`),
what the sampler can search, and a metric name no run logs. What only the data can tell
(the task's metrics) is checked by the first trial before it trains (trial.BadInput).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mpsrun.plugins.components import METRICS
from mpsrun.recipe.load import Resolved
from mpsrun.recipe.problems import did_you_mean
from mpsrun.sweep import gpu_share, space, storage
from mpsrun.sweep.worker import Job, TrialEnd

# What an epoch can log whatever the task (train.assemble.ALWAYS, engine.EpochMetrics), kept here so that
# bad input is answered without importing torch; tests/test_sweep_recipe.py keeps the two lists together.
EPOCH_METRICS = ("train_loss", "val_loss", "lr", "epoch_time_s", "train_time_s", "val_time_s", "train_samples_per_s", "memory_bytes", "grad_norm")


# Set (tests, benchmarks that want every worker in from the first trial): every worker waits until all are ready before
# its first trial (worker 0 for the others' READY lines, the others for the end of their stdin, which worker 0 closes
# then). Why both ways: worker 0 loads its data only once the study and the parent exist, seconds after the others, and
# a fused worker asks for a group at once: the first one ready took every trial of a small sweep. Off by default:
# waiting for the slowest start leaves the device idle meanwhile.
ENV_TOGETHER = "MPSRUN_SWEEP_TOGETHER"


@dataclass
class Plan:
    resolved: Resolved
    storage_url: str
    study: str
    tracking_uri: str | None
    target: int
    workers: int
    notes: list[str] = field(default_factory=list)


def possible_metrics(resolved: Resolved) -> list[str]:
    return list(EPOCH_METRICS) + sorted({f"val_{m}" for ms in METRICS.values() for m in ms})


def plan(resolved: Resolved, trials: int | None, workers: int, storage_url: str | None, study: str | None, tracking_uri: str | None) -> Plan:
    """Everything checked that can be without data; raises RecipeError (exit 2) naming the line."""
    from mpsrun.track.store import client as store

    sweep = check(resolved)
    target = trials or sweep.trials
    notes = []
    if sweep.sampler == "grid" and target > space.grid_size(sweep):
        notes.append(f"sampler grid: {space.grid_size(sweep)} points, so {space.grid_size(sweep)} trials rather than {target}")
        target = space.grid_size(sweep)
    shared = gpu_share.note(workers, resolved.recipe.device)
    if shared:
        notes.append(shared)
    uri, _ = store.resolve_uri(tracking_uri)
    url = storage_url or storage.default_url(uri)
    name = study or resolved.recipe.tracking.experiment or resolved.path.stem
    return Plan(resolved, url, name, tracking_uri, target, workers, notes)


def share_gpu(p: Plan, sharing: str) -> Any:
    """A private NVIDIA MPS daemon where the workers would share a GPU (gpu_share.arrange), its note in the plan's.

    Returns the daemon to stop at the end, or None. ValueError when `nvidia-mps` was asked for and cannot start.
    """
    from mpsrun.sweep import trace

    before = gpu_share.note(p.workers, p.resolved.recipe.device)
    t0 = time.perf_counter()
    daemon, said = gpu_share.arrange(sharing, p.workers, p.resolved.recipe.device)
    if trace.enabled() and said:
        trace.emit(f"sweep-trace-share seconds={time.perf_counter() - t0:.3f} daemon={daemon is not None}")
    p.notes = [n for n in p.notes if n != before] + ([said] if said else [])
    return daemon


def check(resolved: Resolved) -> Any:
    """The sweep section checked as far as it can be without data (`mpsrun validate` too); RecipeError otherwise."""
    from mpsrun.recipe import sweep as rs

    sweep = rs.section(resolved)
    names = possible_metrics(resolved)
    if sweep.metric not in names:
        raise rs.problem(resolved, ("sweep", "metric"), f"no run logs '{sweep.metric}'{did_you_mean(sweep.metric, names)}; metrics: {', '.join(names)}")
    if sweep.direction() is None:
        raise rs.problem(resolved, ("sweep", "metric"), f"cannot tell whether a lower or higher '{sweep.metric}' is better: add `mode: min` or `mode: max`")
    rs.check_values(resolved)
    try:
        space.check(sweep)
    except space.SpaceError as e:
        raise rs.problem(resolved, e.path, str(e)) from None
    return sweep


def create_study(p: Plan) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep = p.resolved.recipe.sweep
    assert sweep is not None
    st = storage.open_storage(p.storage_url)
    direction = "minimize" if sweep.direction() == "min" else "maximize"
    return optuna.create_study(study_name=p.study, storage=st, direction=direction, load_if_exists=True)


@dataclass
class Outcome:
    exit_code: int
    parent_run_id: str
    summary: Any
    notes: list[str]
    message: str = ""


@dataclass
class Early:
    """The extra workers, started before the study and the parent run exist; `send` gives them the whole job."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    pipes: list[int] = field(default_factory=list)  # each worker's report pipe (worker.report_to), read by _relay
    sent: bool = False

    def send(self, job: Job, hold: bool = False) -> None:
        """The job to every worker; `hold`: their stdin left open, so they wait after loading until `go`."""
        self._end_input((job.to_json() + "\n").encode(), close=not hold)
        self.sent = True

    def go(self) -> None:
        """Held workers start their first trial (the end of their stdin); a no-op once it is closed."""
        self._end_input()

    def abandon(self) -> None:
        """The command ends before the workers had their job (bad input, a signal): end them now."""
        if self.sent:
            return
        self._end_input()  # at end of input a worker that is ready ends without a trial
        _signal(self.procs, signal.SIGTERM)  # one still loading is stopped (its MLflow helper ends with it)
        _wait(self.procs, 30.0)
        for fd in self.pipes:
            try:
                os.close(fd)
            except OSError:
                pass
        self.sent = True

    def _end_input(self, line: bytes = b"", close: bool = True) -> None:
        """Each worker's stdin closed (or, `close` off, flushed), after `line` where there is one (the job)."""
        for proc in self.procs:
            try:
                assert proc.stdin is not None
                if line:
                    proc.stdin.write(line)
                if close:
                    proc.stdin.close()
                else:
                    proc.stdin.flush()
            except (OSError, ValueError):  # a worker that already ended (its exit code says why)
                pass


def launch(p: Plan) -> Early:
    """Workers 1..N-1 started now, each loading torch, its MLflow helper and the data while this command opens the study.

    Why: started once the study and the parent run existed, they began their first trial about 10 s after worker 0
    (the H100, 4 workers: 22-24 s into the command against 17 s), a third of a short sweep's wall time.
    """
    early = Early()
    pre = Job(str(p.resolved.path), p.resolved.overrides, p.storage_url, p.study, p.tracking_uri, "", p.target, p.workers)
    from mpsrun.sweep.worker import LATE

    for i in range(1, p.workers):
        r, w = os.pipe()
        early.procs.append(subprocess.Popen([sys.executable, "-m", "mpsrun.sweep.worker", str(i), pre.to_json(), str(w), LATE],
                                            stdin=subprocess.PIPE, start_new_session=True, pass_fds=(w,)))
        os.close(w)
        early.pipes.append(r)
    return early


def run(p: Plan, study: Any, parent_run_id: str, on_end: Callable[[TrialEnd, Any], None] | None = None,
        generation: int | None = 0, early: Early | None = None, tracker: Any = None) -> Outcome:
    """Worker 0 here, workers 1..N-1 as processes; signals stop them all cleanly; results on the parent.

    `generation`: this command's owner claim on the parent (parent.open_parent); None for a guest, which
    publishes the results and closes the parent only if it can claim it when its workers are done.
    `tracker`: worker 0's MLflow helper, started earlier; the parent's results and status are written through
    it too (parent.Via: this process never opens the store), and it is closed here once they are.
    """
    from mpsrun.sweep import parent

    via = parent.Via(tracker) if tracker is not None else None
    try:
        return _run(p, study, parent_run_id, on_end, generation, early, tracker, via)
    finally:
        if tracker is not None:
            tracker.close()  # every record written (the parent's status was waited for); the helper ends


def _run(p: Plan, study: Any, parent_run_id: str, on_end: Callable[[TrialEnd, Any], None] | None, generation: int | None,
         early: Early | None, tracker: Any, via: Any) -> Outcome:
    from mpsrun.exitcodes import EXIT_FAIL, EXIT_INPUT, EXIT_OK
    from mpsrun.sweep import parent, results, trace
    from mpsrun.sweep import trial as trial_mod
    from mpsrun.sweep import worker
    from mpsrun.train.keep import interrupt

    job = Job(str(p.resolved.path), p.resolved.overrides, p.storage_url, p.study, p.tracking_uri, parent_run_id, p.target,
              p.workers, len(study.get_trials(deepcopy=False)))
    if early is None:
        early = launch(p)
    together = os.environ.get(ENV_TOGETHER, "") not in ("", "0")
    early.send(job, hold=together)
    procs: list[subprocess.Popen] = early.procs
    code, message = EXIT_OK, ""
    status = "FINISHED"
    fused_said: list[str] = []  # what worker 0's fused groups said (sweep/fused/work.py): on screen and on the parent
    # Trial ends, from worker 0 here and the others through their pipes, are shown by one thread: worker 0 goes on
    # to its next trial at once instead of reading the study and tagging the parent's progress first.
    ends: queue.Queue = queue.Queue()

    def ended(end: TrialEnd, s: Any) -> None:
        ends.put(end)

    shower = threading.Thread(target=_show, args=(ends, study, on_end), name="mpsrun-sweep-show", daemon=True)
    shower.start()
    reader: threading.Thread | None = None
    early_results: Any = None
    try:
        with interrupt.stop_on_signals():
            pipes = early.pipes
            arrived = threading.Semaphore(0)  # one release per extra worker ready (or ended first)
            if pipes:  # the extra workers' trials, shown on this screen as they end
                reader = threading.Thread(target=_relay, args=(pipes, study, ended, arrived), name="mpsrun-sweep-relay", daemon=True)
                reader.start()
            def all_ready() -> None:
                _all_ready(arrived, len(pipes))
                early.go()

            try:
                tally = worker.work(job, p.resolved, 0, ended, ready=all_ready if together else None, tracker=tracker,
                                    keep_tracker=tracker is not None)
                fused_said = tally.said.all() if tally.said is not None else []
            except trial_mod.BadInput as e:
                code, message = EXIT_INPUT, str(e)
                _signal(procs, signal.SIGTERM)
            finally:
                early.go()  # held workers never wait on a worker 0 that ended before it was ready
            if any(proc.poll() is None for proc in procs):
                _warm_figures()  # while the others finish their last trials: the parent's figures come next
            trace.mark("worker0_ended")
            if generation is not None and code == EXIT_OK and _study_done_first(procs, study, p.target):
                # every trial has ended in the study while the others still close their runs and exit: the parent's
                # results are written meanwhile (their exit took 1-2 s on the H100, after the last trial's end)
                early_results = results.publish(p.resolved, study, parent_run_id, p.tracking_uri, p.target, via)
                trace.mark("published")
            codes = _wait(procs)
            trace.mark("workers_ended")
    except KeyboardInterrupt as e:
        _signal(procs, getattr(e, "signum", signal.SIGINT))
        _wait(procs)
        code, status = interrupt.exit_code(e), "KILLED"
        message = f"interrupted ({getattr(e, 'name', 'SIGINT')})"
        codes = []
    if reader is not None:
        reader.join(timeout=10)  # every worker has ended: its pipe is closed, its last lines read
    ends.put(None)
    shower.join(timeout=60)  # every trial's line shown before the summary
    if code == EXIT_OK and EXIT_INPUT in codes:
        code, message = EXIT_INPUT, "a worker stopped on bad input (its message is above)"
    notes: list[str] = list(fused_said)
    if fused_said:
        parent.notes(p.tracking_uri, parent_run_id, p.notes + fused_said, via)
    if generation is None:  # a guest: the last command out publishes (the owner has let go, or is gone)
        got = parent.claim(p.tracking_uri, parent_run_id, via)
        if got["ok"]:
            parent.take(p.tracking_uri, parent_run_id, got, c=via)
            generation = int(got["generation"])
            notes.append(got["took_over"] or "the parent run's owner has ended: this command published the results and closed it")
        else:
            notes.append(f"the results are the owner's to publish when it ends: {got['message']}")
    if generation is not None:
        if early_results is None:
            early_results = results.publish(p.resolved, study, parent_run_id, p.tracking_uri, p.target, via)
            trace.mark("published")
        summary, more = early_results
        notes += more
    else:
        summary = results.summarise(p.resolved, study)
    if code == EXIT_OK:
        interrupted = [c for c in codes if c in (130, 143)]
        if interrupted:
            code, status = interrupted[0], "KILLED"
        elif summary.complete == 0:
            code, status = EXIT_FAIL, "FAILED"
            message = "no trial completed"
    elif code == EXIT_INPUT:
        status = "FAILED"
    if generation is not None:
        parent.close(p.tracking_uri, parent_run_id, status, generation, via)
        trace.mark("parent_closed")
    return Outcome(code, parent_run_id, summary, notes, message)


def _study_done_first(procs: list[subprocess.Popen], study: Any, target: int) -> bool:
    """Wait until the study holds `target` counted trials and none runs (True), or every worker has exited (False)."""
    while any(proc.poll() is None for proc in procs):
        done, running = storage.budget(study, target)
        if done >= target and running == 0:
            return True
        time.sleep(0.05)
    return False


def _warm_figures() -> None:
    """Import matplotlib's pyplot on a thread (about 1 s), while this worker waits for the others' last trials."""
    from mpsrun.sweep import head

    threading.Thread(target=head.figures_import, name="mpsrun-warm-figures", daemon=True).start()


def _show(ends: "queue.Queue[TrialEnd | None]", study: Any, on_end: Callable[[TrialEnd, Any], None] | None) -> None:
    """Show each trial's end (the caller's `on_end`) in the order they come, until None."""
    while True:
        end = ends.get()
        if end is None:
            return
        if on_end is not None:
            try:
                on_end(end, study)
            except Exception:  # noqa: BLE001 - a line not shown must not hide the others
                pass


def _all_ready(arrived: threading.Semaphore, n: int, timeout_s: float = 300.0) -> None:
    """MPSRUN_SWEEP_TOGETHER=1: worker 0 waits until every extra worker is ready (or has ended) before its first trial."""
    deadline = time.monotonic() + timeout_s
    for _ in range(n):
        if not arrived.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return


def _relay(fds: list[int], study: Any, on_end: Callable[[TrialEnd, Any], None], arrived: threading.Semaphore) -> None:
    """Read the extra workers' lines (worker.report_to: ready, then each trial's end as JSON) until every pipe closes."""
    import select

    from mpsrun.sweep.worker import READY, end_from_json

    bufs = {fd: b"" for fd in fds}
    said = set()
    while bufs:
        readable, _, _ = select.select(list(bufs), [], [], 1.0)
        for fd in readable:
            chunk = os.read(fd, 65536)
            if not chunk:  # the worker ended
                os.close(fd)
                del bufs[fd]
                if fd not in said:
                    arrived.release()
                continue
            *lines, bufs[fd] = (bufs[fd] + chunk).split(b"\n")
            for line in lines:
                if line == READY and fd not in said:
                    said.add(fd)
                    arrived.release()
                    continue
                try:
                    end = end_from_json(line.decode())
                except (ValueError, TypeError, KeyError):
                    continue  # not a trial's end (a partial line from a worker that died mid-write)
                try:
                    on_end(end, study)
                except Exception:  # noqa: BLE001 - a line not shown must not stop the relay of the others
                    pass


def _signal(procs: list[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass


def _wait(procs: list[subprocess.Popen], timeout_s: float = 120.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    out = []
    for proc in procs:
        try:
            out.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            out.append(proc.wait())
    return out


def eta(start: float, done_at_start: int, done: int, target: int) -> str:
    """Remaining time at the pace of this command's finished trials (all workers together)."""
    made = done - done_at_start
    if made <= 0 or done >= target:
        return ""
    left = (time.monotonic() - start) / made * (target - done)
    return f"ETA {int(left // 60)}m{int(left % 60):02d}s" if left >= 60 else f"ETA {left:.0f}s"

