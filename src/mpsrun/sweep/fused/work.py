"""The worker's ask/tell loop when trials fuse: ask a group's trials together, train what fuses as one, tell each as it ends.

Optuna is asked for up to a group's size of trials at once (TPE with its constant liar, so
the ones asked after see the ones still running; random, qmc, grid and CMA-ES's population
as they are), each told its value when that member ends. Trials whose recipes cannot fuse
(different widths, batch sizes, optimizers; a recipe feature the fused step lacks) run as
without fusing, one by one (`run_one`, the worker's own path), and the notes say which and
why, once. Heartbeats, lost trials and the budget are the worker's as for any trial.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Callable

from mpsrun.recipe.load import Resolved
from mpsrun.sweep import space, storage
from mpsrun.sweep.fused import group as grouping
from mpsrun.sweep.fused import stop

MAX_GROUP = 256
STARTUP = 4  # the median pruner's n_startup_trials (space.pruner): it compares with finished trials only


def size(resolved: Resolved, placement: dict[str, Any], cache: Any) -> tuple[int, str]:
    """The largest group and the note that says how it was chosen (sweep.fuse: N, or auto from free memory)."""
    fuse = resolved.recipe.sweep.fuse if resolved.recipe.sweep else "auto"
    if fuse != "auto":
        return int(fuse), f"fuse: groups of up to {int(fuse)} trials (sweep.fuse: {fuse})"
    from mpsrun.devices import resolve as devices
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep.fused.members import member_bytes
    from mpsrun.train import runner
    from mpsrun.train.loop.data import raw_tensors

    r = trial_recipe(resolved, placement)
    try:
        device = devices.resolve(r.recipe.device, r.recipe.device_fallback).device
        splits = cache.get(r)
        runner.seed_everything(r.recipe.seed)
        model = runner.build_model(r.recipe, splits)
        x = raw_tensors(splits.train)
        sample = splits.transform(x[0][:1]).squeeze(0) if x is not None and splits.transform is not None else x[0][0] if x is not None else None
        per = member_bytes(model, r.recipe.batch_size, sample) if sample is not None else sum(p.numel() for p in model.parameters()) * 16
    except Exception as e:  # noqa: BLE001 - the first group finds the problem again and says it
        return 16, f"fuse: groups of up to 16 trials (auto could not estimate a member's memory: {type(e).__name__}: {e})"
    free = devices.free_memory_bytes(device)
    where = f"{device}"
    if free is None:
        from mpsrun.plugins.builtin.images.memory import host_available

        free = host_available()
        where = f"{device} (available host memory)"
        if free is None:
            free, where = 8 * 2**30, f"{device} (assumed: this host does not say how much memory is available)"
    n = max(1, min(MAX_GROUP, int(free * 0.5 // max(per, 1))))
    return n, (f"fuse: groups of up to {n} trials (sweep.fuse: auto; {free / 2**30:.1f} GiB free on {where}, "
               f"about {per / 2**20:.2f} MiB a member: half the free memory, at most {MAX_GROUP})")


def group_size(most: int, target: int, done: int, running: int, workers: int, pruner: str) -> tuple[int, list[str]]:
    """How many trials the next group asks for (of `target`, `done` counted and `running` elsewhere), and the notes
    that say why it is fewer than `most`."""
    n, why = min(most, target - done - running), []
    if workers > 1:  # each worker its share of the trials not yet done (a group per GPU), not the first to ask all
        share = -(-(target - done) // workers)
        if share < n:
            n = share
            why.append(f"fuse: {workers} workers, so a worker's group takes its share of the trials left (1/{workers}), not all of them")
    if pruner == "median" and done < STARTUP:
        n = min(n, STARTUP - done)
        why.append(f"fuse: the median pruner compares with finished trials, so the first {STARTUP} train as groups of their own")
    return n, why


def stand_ins(resolved: Resolved, placement: dict[str, Any], n: int) -> list[Any]:
    """`n` members as the first group's would be, for a rehearsal (sweep/head.py): the recipe's values, and their own
    seeds where the sweep searches `seed` (each its own batches: the group's first layers take other shapes)."""
    import types

    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep.fused.members import Member

    sweep = resolved.recipe.sweep
    own = sweep is not None and "seed" in sweep.params
    out = []
    for i in range(n):
        values = {"seed": resolved.recipe.seed + i} if own else {}
        out.append(Member(types.SimpleNamespace(number=-1 - i), values, trial_recipe(resolved, {**values, **placement}), {}))
    return out


class Said:
    """The notes of a worker's fused groups, each said once (trial numbers gathered per reason)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.alone: dict[str, list[int]] = {}

    def add(self, line: str) -> None:
        if line not in self.lines:
            self.lines.append(line)

    def unfused(self, number: int, why: str) -> None:
        self.alone.setdefault(why, []).append(number)

    def all(self) -> list[str]:
        out = list(self.lines)
        for why, numbers in self.alone.items():
            out.append(f"fuse: trial{'s' if len(numbers) > 1 else ''} {', '.join(map(str, sorted(numbers)))} ran unfused: {why}")
        return out


def loop(job: Any, resolved: Resolved, index: int, tracker: Any, study: Any, marker: Any, cache: Any, placement: dict[str, Any],
         run_one: Callable[[Any, dict[str, Any]], None], finish: Callable[[Any, Any, dict[str, Any], float], None], said: Said) -> None:
    """Groups until the study holds `job.target` counted trials. `run_one(t, values)`: a trial unfused (the worker's path);
    `finish(t, outcome, values, start)`: tell the study, tag the run, show the line."""
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep.trial import Outcome

    sweep = resolved.recipe.sweep
    assert sweep is not None
    most, note = size(resolved, placement, cache)
    said.add(note)
    data: dict[str, Any] = {}  # the groups' datasets by trial.data_key
    if getattr(cache, "key", None) is not None:  # the one the worker's cache built (size's estimate, the warm start): not built again
        data[cache.key] = cache.splits
    while True:
        storage.reap(study, lambda t, why: storage.lost_run(t, f"its worker died ({why})", marker.lost))
        done, running = storage.budget(study, job.target)
        left = job.target - done - running
        if left <= 0:
            break
        n, why = group_size(most, job.target, done, running, job.workers, sweep.pruner)
        for line in why:
            said.add(line)
        asked = []
        for _ in range(n):
            t = storage.ask(study, job.target)
            if t is None:  # another worker took the last place at the same moment
                break
            start = time.perf_counter()
            try:
                values = space.suggest(t, sweep)
                asked.append((t, values, trial_recipe(resolved, {**values, **placement}), start))
            except Exception as e:  # noqa: BLE001 - a combination the recipe rejects: this trial fails, the sweep goes on
                finish(t, Outcome("FAILED", None, None, f"{type(e).__name__}: {e}"), {}, start)
        if not asked:
            continue  # every trial asked failed before training (or another worker took the last place): the budget says
        try:
            groups, alone = grouping.partition(asked, lambda it: it[2], most)
            for (t, values, _r, _s), why in alone:
                said.unfused(t.number, why)
                run_one(t, values)
            for g in groups:
                _group(job, sweep, g, tracker, study, marker, data, run_one, finish, said, index)
        except KeyboardInterrupt as e:  # the trials asked and not told yet (waiting their turn): lost, queued again
            stop.lose(study, [it[0] for it in asked], f"interrupted ({getattr(e, 'name', 'SIGINT')})")
            raise


def _group(job: Any, sweep: Any, items: list[tuple], tracker: Any, study: Any, marker: Any, data: dict[str, Any],
           run_one: Callable, finish: Callable, said: Said, index: int) -> None:
    """One fused group, from its members' build to each one's end.

    A signal (SIGINT/SIGTERM) stops the training at once; the group's bookkeeping is held against it
    (stop.held), then every member not yet told keeps each epoch it finished, its run ends KILLED and
    its trial is lost and queued again (stop.abandon), as an interrupted unfused trial's is.
    """
    from mpsrun.sweep import trace
    from mpsrun.sweep import trial as trial_mod
    from mpsrun.sweep.fused import engine, graphed, members, record

    lap = trace.Phases() if trace.enabled() else None
    mems = [members.Member(t, values, r, trial_mod.trial_tags(job.study, t, values)) for t, values, r, _ in items]
    starts = {m.number: s for m, (_, _, _, s) in zip(mems, items)}
    beats = [storage.heartbeat_thread(study, m.trial._trial_id) for m in mems]  # noqa: SLF001
    told: set[int] = set()  # members whose trial the study has been told (finish): no longer the signal's to settle
    posted: dict[int, int] = {}  # member number -> epochs of its metrics posted to its run
    notes: list[str] = []
    try:
        try:
            b = members.build(mems, data)
        except Exception as e:  # noqa: BLE001 - Unfusable or a failed build: the group's trials run one by one, as without fusing
            why = str(e) if isinstance(e, members.Unfusable) else f"the group could not be built ({type(e).__name__}: {e})"
            for m in mems:
                said.unfused(m.number, why)
            for m in mems:
                run_one(m.trial, m.values)
            return
        def fell_back(note: str) -> None:  # a capture that failed mid-run: said, and in every member's notes at its end
            said.add(note)
            notes.append(note)

        g, graphs_note = graphed.group_for(b, fell_back)
        gid = f"{index}-{uuid.uuid4().hex[:8]}"
        notes[:] = [f"fused: trained with {len(mems) - 1} other trial{'s' if len(mems) > 2 else ''} as one step (group {gid})"]
        if graphs_note:
            notes.append(graphs_note)
        _check_metric(sweep, b, mems, study)
        if lap is not None:
            lap.lap("prepare")
        with stop.held():  # the runs and their ids on the trials together: never runs that no trial knows (parent.settle_lost)
            record.begin(tracker, b, gid, job.parent_run_id, notes)
        if lap is not None:
            lap.lap("open")
        rows: list[tuple] = []

        def on_epoch(m: members.Member, e: int, metrics: dict[str, float]) -> tuple[str, str] | None:
            with stop.held():  # the pruner's report and question write the study (its journal's lock)
                return verdict(m, e, metrics)

        def verdict(m: members.Member, e: int, metrics: dict[str, float]) -> tuple[str, str] | None:
            rows.append((m, e, metrics))
            bad = engine.nonfinite(metrics, e, b.epochs)
            value = metrics.get(sweep.metric)
            if value is None:
                return "FAILED", f"KeyError: sweep.metric '{sweep.metric}' is not among this run's metrics: {', '.join(sorted(metrics))}"
            m.value = float(value)
            if bad:
                return "FAILED", bad
            if not math.isfinite(m.value):
                return None
            m.trial.report(m.value, e)  # after its early stopping (the engine's), as a trial's Report follows a run's callbacks
            if e + 1 < b.epochs and m.trial.should_prune():
                return "PRUNED", f"pruned by Optuna's {sweep.pruner} pruner after epoch {e + 1} ({sweep.metric} {m.value:.6g})"
            return None  # a member that stopped early ends COMPLETE (engine.py), told its last epoch's value

        pace = record.Pace(record.EVERY_S)

        def post_rows() -> None:  # the epochs not yet posted, in one call (one batch per member's run)
            record.epoch(tracker, rows)
            for m, ep, _ in rows:
                posted[m.number] = ep + 1
            rows.clear()

        epoch_s: list[float] = []  # each epoch's seconds (the trace's group line: the first holds the captures)

        def listen(e: int, seconds: float) -> None:
            epoch_s.append(seconds)
            ended = [m for m in mems if m.state != "RUNNING" and m.number not in told]  # this epoch's: pruned, failed, stopped early
            with stop.held():  # the epochs posted whole, and the members that ended told, before a signal stops the group
                if ended or pace.due():
                    post_rows()
                if ended:
                    _end(ended, tracker, notes, finish, starts, trial_mod, told)

        threads = torch_threads(b.device)
        try:
            g.run(on_epoch, listen)
        except Exception as e:  # noqa: BLE001 - out of memory, a layer that failed: the group's running members fail with it
            for m in g.active:
                m.state, m.message = "FAILED", f"{type(e).__name__}: {e}"
        finally:
            if threads:
                import torch

                torch.set_num_threads(threads)
        if lap is not None:
            lap.lap("train")
        with stop.held():
            post_rows()
            _end(list(g.active), tracker, notes, finish, starts, trial_mod, told)
        if lap is not None:
            lap.lap("close")
            trace.emit(lap.line(index, -len(mems)).replace("sweep-trace ", "sweep-trace-group ", 1)
                       + " epochs=" + ",".join(f"{x:.2f}" for x in epoch_s) + f" capture={getattr(g, 'capture_s', 0.0):.3f}")
    except KeyboardInterrupt as e:
        stop.abandon(study, tracker, [m for m in mems if m.number not in told], posted, notes, f"interrupted ({getattr(e, 'name', 'SIGINT')})")
        raise
    finally:
        for beat in beats:
            beat.join()


def _check_metric(sweep: Any, b: Any, mems: list[Any], study: Any) -> None:
    """A metric this task never logs is bad input (exit 2), found before training, as a trial's own check finds it."""
    from mpsrun.sweep import trial as trial_mod
    from mpsrun.sweep.fused.controls import types_objective
    from mpsrun.train.assemble import metric_names

    try:
        trial_mod.check_metric(sweep.metric, metric_names(types_objective(b.members[0])))
    except trial_mod.BadInput:
        for m in mems:
            storage.fail_bad_input(study, m.trial)
        raise


def torch_threads(device: Any) -> int:
    """On the CPU the group runs on one thread (returns the count to give back; 0: unchanged).

    Why: the fused CPU step is many small kernels (a member's matmuls one by one, for its exact
    numbers); on the 2-core machine, with two threads they waited on each other: 16 digits members
    trained 3 epochs in 1.7 s on one thread and 13-20 s on two while other processes held the cores.
    """
    if device.type != "cpu":
        return 0
    import torch

    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
        return n
    return 0


def _end(ended: list[Any], tracker: Any, notes: list[str], finish: Callable, starts: dict[int, float], trial_mod: Any,
         told: set[int]) -> None:
    """Members that ended: their runs closed, then the study told (as a trial's end is, in that order)."""
    from mpsrun.sweep.fused import record

    for m in ended:
        if m.state == "COMPLETE" and (m.value is None or not math.isfinite(m.value)):
            m.state, m.message = "FAILED", f"the metric is {m.value} at the last epoch"
    record.end(tracker, ended, notes)
    for m in ended:
        finish(m.trial, trial_mod.Outcome(m.state, m.value, m.run_id, m.message), m.values, starts.get(m.number, time.perf_counter()))
        told.add(m.number)
