"""From a validated recipe to a finished MLflow run.

The one place that wires recipe -> plugins -> device -> data -> model -> tracking
-> engine, in that order, so `cli.py` stays a thin shell and the engine knows
nothing of MLflow or YAML.
"""

from __future__ import annotations

import copy

import inspect
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from mpsrun.devices import canary
from mpsrun.devices import resolve as devices
from mpsrun.devices import host
from mpsrun.plugins import registry as plugins
from mpsrun.plugins.contract import DataSplits
from mpsrun.recipe.load import Resolved, flatten
from mpsrun.recipe.model import Recipe
from mpsrun.track.store import client as tracking
from mpsrun.track.store import owner
from mpsrun.track.store.runs import EPOCHS_DONE_TAG
from mpsrun.track.records import names as mlflow_names
from mpsrun.track.records.standard import TIMINGS_FILE, bookkeeping
from mpsrun.train import assemble as controls
from mpsrun.train.precision import resolve_precision
from mpsrun.train.ranks import distributed
from mpsrun.train.keep import final_eval
from mpsrun.train.ranks import job_run
from mpsrun.train import record
from mpsrun.train import warm
from mpsrun.train.controls import schedulers
from mpsrun.train.loop import augment, shards
from mpsrun.train.controls.callbacks import Callback, Callbacks, RunState  # noqa: F401 - Callbacks: public here
from mpsrun.train.keep.continuity import Continuity, ResumePoint
from mpsrun.train.keep.shown import ShownAfterRecord
from mpsrun.train.loop.data import BatchPlan, plan_batches
from mpsrun.train.loop.engine import Listener, Listeners, Options, TrainResult, train
from mpsrun.train.setup import InputError, OwnerConflict, RunFailed, Setup  # noqa: F401 - public here: callers catch runner.InputError


@dataclass
class RunSummary:
    run: tracking.RunInfo
    result: TrainResult
    setup: Setup
    mlflow_log_time_s: float
    model_uri: str | None = None  # runs:/ID/model, or models:/NAME/VERSION when registered
    test_metrics: dict[str, float] = field(default_factory=dict)  # the test split, once at the end (the CLI prints them)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every device's generator too


def build_data(recipe: Recipe, resolved: Resolved) -> DataSplits:
    from mpsrun.plugins.builtin.datasets import DatasetUnavailable

    filled = {"seed": recipe.seed, "recipe_dir": str(resolved.path.resolve().parent)}
    try:
        splits = plugins.build("dataset", recipe.dataset.name, recipe.dataset.kwargs, filled)
    except (DatasetUnavailable, plugins.PluginError) as e:
        raise InputError(str(e)) from None
    if not isinstance(splits, DataSplits):
        raise InputError(
            f"dataset plugin '{recipe.dataset.name}' returned {type(splits).__name__}, not mpsrun.DataSplits"
        )
    return splits


def build_model(recipe: Recipe, splits: DataSplits) -> nn.Module:
    try:
        outputs = controls.num_outputs(splits)
    except controls.ControlError as e:
        raise InputError(str(e)) from None
    filled = {"num_classes": splits.num_classes, "num_outputs": outputs, "input_shape": tuple(splits.input_shape), "data_info": dict(splits.info)}
    try:
        model = plugins.build("model", recipe.model.name, recipe.model.kwargs, filled)
    except plugins.PluginError as e:
        raise InputError(str(e)) from None
    if not isinstance(model, nn.Module):
        raise InputError(f"model plugin '{recipe.model.name}' returned {type(model).__name__}, not torch.nn.Module")
    return model


def resolve_options(recipe: Recipe, device: torch.device, model: nn.Module, plan: BatchPlan) -> Options:
    """Turn each `auto` into a concrete choice for this device; every skip becomes a note."""
    notes: list[str] = []
    precision, why = resolve_precision(recipe.precision, device)  # train/precision.py
    if why:
        notes.append(why)
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    if recipe.channels_last == "auto":
        channels_last = device.type == "cuda" and has_conv
    else:
        channels_last = bool(recipe.channels_last)
    compile_ = recipe.compile is True
    if recipe.graphs == "auto":
        graphs = device.type == "cuda" and plan.graphable and precision != "fp16" and not compile_
    else:
        graphs = bool(recipe.graphs)
        if graphs and device.type != "cuda":
            notes.append(f"graphs: CUDA graphs need a CUDA device, not {device.type}; running eager")
            graphs = False
        elif graphs and not plan.graphable:
            notes.append("graphs: CUDA graphs need device-resident data; running eager")
            graphs = False
        elif graphs and precision == "fp16":
            notes.append("graphs: fp16's grad scaler syncs with the host every step; running eager")
            graphs = False
        elif graphs and compile_:
            notes.append("graphs: torch.compile is on, which manages its own graphs; skipping CUDA graphs")
            graphs = False
    if recipe.cudnn_benchmark == "auto":
        cudnn_benchmark = device.type == "cuda" and has_conv
    else:
        cudnn_benchmark = bool(recipe.cudnn_benchmark) and device.type == "cuda"
    return Options(
        precision=precision,
        channels_last=channels_last,
        compile=compile_,
        graphs=graphs,
        log_every=recipe.log_every,
        notes=notes,
        cudnn_benchmark=cudnn_benchmark,
    )


def build_optimizer(recipe: Recipe, model: nn.Module, graphs: bool) -> torch.optim.Optimizer:
    cls = plugins.optimizer_class(recipe.optimizer.name)
    kwargs, errs = plugins.validate_kwargs(cls, recipe.optimizer.kwargs, ("params",))
    if errs:
        raise InputError("; ".join(f"optimizer.{k}: {m}" for k, m in errs))
    if graphs and "capturable" in inspect.signature(cls).parameters and "capturable" not in kwargs:
        kwargs["capturable"] = True  # step counters on the device, so the step can be graphed
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and schedulers.fused_sgd(cls, kwargs, params, params[0].device, graphs, recipe.scheduler is not None)
    if fused:
        kwargs["fused"] = True  # reads the schedule's device-tensor rate in one kernel (schedulers.tensor_lr)
    optimizer = cls(model.parameters(), **kwargs)
    if fused:
        optimizer.register_step_pre_hook(schedulers.late_momentum_buffers)
    return optimizer


def prepare(resolved: Resolved, splits: DataSplits | None = None) -> Setup:
    """Device, data, model, optimizer and options; raises InputError for bad input.

    `splits`: the dataset already built from the same `dataset:` section and seed (a sweep's
    worker builds it once for all its trials); the model's seed is set after it either way.
    """
    recipe = resolved.recipe
    if (recipe.device == "auto" or recipe.device.startswith("cuda")) and torch.backends.cuda.is_built():
        warm.dynamo()  # the optimizer's import of torch._dynamo, beside CUDA's start and the data's load
    try:
        choice = devices.resolve(recipe.device, recipe.device_fallback)
    except devices.DeviceUnavailable as e:
        raise InputError(str(e)) from None
    notes = [w for w in [choice.warning()] if w]
    job = distributed.from_env()  # one of several ranks (mpsrun run --nproc, torchrun)
    if job is not None:
        try:
            notes += distributed.join(job, choice, recipe.batch_size)  # sets each rank's GPU
        except ValueError as e:
            raise InputError(str(e)) from None
    else:
        devices.make_current(choice.device)
    if choice.device.type == "cuda":
        warm.triton_key()  # the fused kernels' first launch hashes Triton's library: on a thread, while data and model load
    seed_everything(recipe.seed)
    # a sweep worker's splits are shared by its trials: augment a copy (augment_data replaces its transform)
    splits = build_data(recipe, resolved) if splits is None else copy.copy(splits)
    aug = augment_data(recipe, splits)
    seed_everything(recipe.seed)  # the model's initial weights depend on the seed alone
    model = build_model(recipe, splits)
    device = choice.device
    plan = plan_batches(
        splits.train,
        splits.val,
        batch_size=recipe.batch_size,
        device=device,
        seed=recipe.seed,
        transform=splits.transform,
        train_transform=aug.train if aug is not None else None,
        resident=recipe.resident,
        max_bytes="auto" if recipe.resident_max_gb == "auto" else int(recipe.resident_max_gb * 2**30),
        free_bytes=devices.free_memory_bytes(device),
        num_workers=recipe.loader.num_workers,
        persistent_workers=recipe.loader.persistent_workers,
        pin_memory=recipe.loader.pin_memory,
    )
    plan, share_notes = shards.share(plan, recipe.batch_size, recipe.seed)
    notes += share_notes
    options = resolve_options(recipe, device, model, plan)
    distributed.adjust_options(options, recipe.graphs)
    controls.adjust_options(recipe, options)  # what CUDA graphs cannot carry, before `capturable` is decided
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = options.cudnn_benchmark  # fixed shapes: time algorithms once
    model = model.to(device)
    if options.channels_last:
        model = model.to(memory_format=torch.channels_last)
    early = warm.in_the_wait(recipe, device, model, splits, options) if job is None else None  # the canary, the kernels
    model = distributed.wrap(model, device, options.graphs)  # DDP (or graph_sync under graphs) when one of several ranks
    optimizer = build_optimizer(recipe, model, options.graphs)
    try:
        ctl = controls.build(recipe, splits, model, optimizer, plan, options, device)
    except controls.ControlError as e:
        raise InputError(str(e)) from None
    notes += ctl.notes + splits.info.get("notes", [])
    if options.compile:
        model = _compile(model, options)
    return Setup(resolved, choice, splits, model, optimizer, plan, options, notes, list(ctl.callbacks), ctl.objective, ctl.extras,
                 aug.params if aug is not None else {}, canary=early)


def augment_data(recipe: Recipe, splits: DataSplits) -> augment.Augmentation | None:
    """The recipe's `augment:` for this dataset: the training transform, and the evaluation transform
    and input shape (the augmented size) put in the splits' place, so the model, validation and the
    logged model all see what training sees."""
    if not recipe.augment:
        return None
    from mpsrun.train.loop.data import raw_tensors

    raw = raw_tensors(splits.train)
    shape = tuple(raw[0].shape[1:]) if raw is not None else tuple(torch.as_tensor(splits.train[0][0]).shape)
    try:
        aug = augment.build(recipe.augment, splits.transform, shape)
    except augment.AugmentError as e:
        raise InputError(str(e)) from None
    assert aug is not None
    splits.transform, splits.input_shape = aug.eval, aug.input_shape
    return aug


def _compile(model: nn.Module, options: Options) -> nn.Module:
    try:
        return torch.compile(model)  # type: ignore[return-value]
    except Exception as e:
        options.notes.append(f"compile: torch.compile failed ({type(e).__name__}: {e}); running eager")
        options.compile = False
        return model


def run_tags(setup: Setup) -> dict[str, str]:
    r = setup.resolved
    tags = devices.choice_tags(setup.choice)
    tags.update(
        {
            "mpsrun.recipe": str(r.path),
            "mpsrun.overrides": " ".join(r.overrides),
            "mpsrun.version": _version(),
            "mpsrun.command": " ".join(sys.argv),
            "data.path": setup.plan.path,
            "data.path_reason": setup.plan.reason,
            "memory.kind": devices.memory_kind(setup.choice.device),
        }
    )
    data_tags = setup.splits.info.get("tags") if isinstance(setup.splits.info, dict) else None
    if isinstance(data_tags, dict):  # the dataset's own (image_folder: mpsrun.data.cache, mpsrun.data.skipped)
        tags.update({str(k): str(v) for k, v in data_tags.items()})
    for kind in ("dataset", "model"):  # which package's code ran, not just its name
        ref = plugins.find(kind, getattr(r.recipe, kind).name)
        tags[f"plugin.{kind}"] = f"{ref.distribution} {ref.version} ({ref.value})"
    for i, note in enumerate(setup.notes + setup.options.notes):
        tags[f"mpsrun.note.{i}"] = note
    tags.update(r.recipe.tracking.tags)
    return tags


def _version() -> str:
    from mpsrun import __version__

    return __version__


def experiment_name(resolved: Resolved) -> str:
    """The run's MLflow experiment: the recipe's `tracking.experiment`, else the recipe file's name."""
    return resolved.recipe.tracking.experiment or resolved.path.stem


def execute(setup: Setup, tracking_uri: str | None, listener: Listener | None = None, parent_run_id: str | None = None, tags: dict[str, str] | None = None, resume: ResumePoint | None = None, experiment: str | None = None, tracker: Any = None) -> RunSummary:
    """The life of a run: open it in MLflow, train with its callbacks, close it, whatever the outcome.

    `tracker`: one already being set up (`track.helper.background`, started before torch
    was imported); by default one is set up here. `resume`: the same MLflow run goes on.
    """
    recipe = setup.resolved.recipe
    if tracker is None:
        uri, artifact_root = tracking.resolve_uri(tracking_uri)
        tracker = job_run.tracker(uri, experiment or experiment_name(setup.resolved), artifact_root)  # rank 0 alone writes
    phases = {"prepared": host.since_start()}  # where a short run's wall time goes (mpsrun_timings.json)
    record.model_ahead(tracker, setup)  # the exporter process (if any) exports while the run opens and trains
    try:
        info, all_tags, generation = _open_run(setup, tracker, parent_run_id, tags, resume)
    except OwnerConflict:  # another live process owns the run: nothing written, nothing to mark
        getattr(tracker, "close", lambda wait=True: None)(wait=False)
        raise
    phases["run_opened"] = host.since_start()
    rec = record.open_for(tracker, setup)  # experiment kind, standard tags, datasets, system metrics
    phases["records_begun"] = host.since_start()
    shown = ShownAfterRecord(listener)  # an epoch's line is printed once its metrics and checkpoint are handed over
    listeners = _listeners(setup, tracker, shown, resume, rec)
    keep = Continuity(setup, tracker, all_tags, listeners.on_note, resume)  # liveness, non-finite guard, checkpoints
    keep.claim = generation  # let go of when the run ends, whatever the outcome
    listeners.items.append(keep.guard.listener)
    state = RunState(setup.model, setup.optimizer, setup.choice.device, recipe.epochs, log=tracker)
    state.extras.update(setup.extras)  # the LR scheduler: checkpoints save and restore it
    try:
        canary.guard(setup, tracker.set_tags, listeners.on_note)  # wrong-answer ops stop the run here
        phases["canary_done"] = host.since_start()
        result = train(setup.model, setup.optimizer, setup.plan, setup.choice.device, recipe.epochs, setup.options, listeners,
                       callbacks=Callbacks(keep.callbacks([*setup.callbacks, *record.callbacks(rec)]), shown.as_callback()), state=state,
                       start_epoch=keep.start_epoch, objective=setup.objective)
        keep.after_fit(state, setup.model)  # model_from: best puts the best weights back before they are logged
        phases["trained"] = host.since_start()
        t_test = time.perf_counter()
        test_metrics = _test(setup, tracker)  # after that: on the weights that are logged
        rec.timings["test_eval_time_s"] = time.perf_counter() - t_test
        phases["tested"] = host.since_start()
        if all(v is not None for v in phases.values()):
            rec.timings["since_process_start_s"] = phases  # type: ignore[assignment]
        _close_records(setup, tracker, rec, result, listeners, keep.bookkeeping)
    except KeyboardInterrupt as e:
        shown.drop_held()  # stopped before the epoch's records were handed over: its line is not shown
        record.stop(rec)
        keep.interrupted(e, state.epoch)
        keep.close()
        peer = distributed.on_failure(e, tracker)  # the agent's SIGTERM after a rank died: FAILED, naming that rank
        if peer is not e:
            tracker.finish("FAILED", peer)
            raise RunFailed(f"{type(peer).__name__}: {peer}", info.run_id) from peer
        tracker.finish("KILLED")
        raise
    except Exception as e:
        shown.show_held()  # the epoch that failed (a non-finite loss) is shown before the failure is said
        e = distributed.on_failure(e, tracker)  # names the rank that brought a job down
        record.stop(rec)
        keep.close()
        tracker.finish("FAILED", e)
        raise RunFailed(f"{type(e).__name__}: {e}", info.run_id) from e
    keep.close()
    tracker.finish("FINISHED")
    model_uri = rec.model.registered or rec.model.model_uri if rec.model else None
    return RunSummary(info, result, setup, tracker.log_time_s, model_uri, test_metrics)


def _open_run(setup: Setup, tracker: Any, parent_run_id: str | None, tags: dict[str, str] | None, resume: ResumePoint | None) -> tuple[tracking.RunInfo, dict[str, str], int | None]:
    """Claim the run (track/store/owner.py), start it (or attach to the one a resume continues) with its
    tags, params and recipe text. Returns the run, its tags and this process's owner claim (None: not rank 0).

    A resume claims the run before writing anything to it: another live owner raises OwnerConflict.
    """
    r = setup.resolved
    job_tags, rank_facts = job_run.job_tags(setup.choice.device, devices.choice_tags(setup.choice))
    all_tags = {**run_tags(setup), **job_tags, **(tags or {})}
    main = distributed.is_main_process()
    generation: int | None = None
    if resume is None:
        claim = owner.me(0)  # a new run: claim 0 goes in with its params
        info = tracker.start(r.recipe.tracking.run_name or record.default_run_name(setup), {**all_tags, **owner.tags_for(0, claim.who(), None)}, parent_run_id)
        tracker.log_params({**flatten(r.as_dict()), **setup.options.as_params(), **setup.params, "data.train_size": setup.plan.train.samples, "data.val_size": setup.plan.val.samples,
                            **({claim.key: claim.value()} if main else {})})
        generation = 0 if main else None
    else:  # the same run goes on; its params stay as first logged (MLflow params are immutable)
        got = claim_run(tracker, resume.run_id, resume.owner_base) if main else None
        info = tracker.attach(resume.run_id)
        if got is not None:
            generation = int(got["generation"])
            tracker.set_tags(owner.tags_for(generation, got["owner"], got["took_over"]))
            if got["took_over"]:
                setup.notes.append(got["took_over"])  # said on screen with the other notes
        if job_tags:  # the ranks that train now (pids, devices; the world size: see Continuity)
            tracker.set_tags(job_tags)
    job_run.publish_run_id(info.run_id)
    tracker.log_text(r.as_yaml(), "recipe.yaml")
    if rank_facts:
        tracker.log_text(json.dumps(rank_facts, indent=2), "distributed_ranks.json")
    if setup.splits.info:  # e.g. tabular's category vocabularies: needed to use the weights later
        tracker.log_text(json.dumps(setup.splits.info, indent=2, default=str), "data_info.json")
    return info, all_tags, generation


def claim_run(tracker: Any, run_id: str, base: int | None = None) -> dict[str, Any]:
    """Claim an existing run for this process before writing to it (one owner per run, track/store/owner.py).

    Raises OwnerConflict naming the live owner. Returns the claim ({"generation", "owner",
    "took_over"}); whoever claims lets go at the end with `release_run`. `base`: the newest
    claim seen when the caller planned (a resume's checkpoint), None when there is no plan to keep.
    """
    got = tracker.claim_owner(run_id, base, owner.me())
    if not got["ok"]:
        raise OwnerConflict(got["message"])
    return got


def release_run(tracker: Any, generation: int) -> None:
    """Let go of a run claimed with `claim_run` (before its status is set: the next owner waits for both)."""
    tracker.set_tags({owner.RELEASED: str(generation)})


def _listeners(setup: Setup, tracker: Any, listener: Listener | None, resume: ResumePoint | None, rec: record.Recorder) -> Listeners:
    """The caller's listener (the progress bar) and the one that logs each epoch's metrics; the notes so far said."""
    landed = resume.landed if resume is not None else frozenset()

    class _Log(Listener):
        def on_epoch_end(self, m):  # type: ignore[no-untyped-def]
            if m.epoch not in landed:  # else logged before the stop, its checkpoint not (train/keep/resume.py: _landed_after)
                tracker.log_metrics(mlflow_names.to_mlflow(m.metrics()), step=m.epoch)  # train_loss's steps say which epochs landed (resume)
            tracker.set_tags({EPOCHS_DONE_TAG: str(m.epoch + 1)})  # what `mpsrun runs` shows

    listeners = Listeners(listener, _Log())
    if landed:
        listeners.on_note(f"resume: epoch {', '.join(str(e + 1) for e in sorted(landed))}'s metrics reached the run before the stop "
                          "but not its checkpoint; trained again from the checkpoint, not logged twice")
    for note in setup.notes + setup.options.notes + rec.notes:
        listeners.on_note(note)
    setup.notes.extend(rec.notes)
    return listeners


def _test(setup: Setup, tracker: Any) -> dict[str, float]:
    """The test split, once, when the dataset has one."""
    if setup.splits.test is None or setup.objective is None:
        return {}
    metrics = final_eval.evaluate(setup.model, setup.optimizer, setup.objective, setup.splits.test, setup.resolved.recipe.batch_size,
                                  setup.choice.device, setup.options, setup.splits.transform)
    # the split's size is a param beside data.train_size and data.val_size, not a chart among the user's test results
    tracker.log_metrics({k: v for k, v in metrics.items() if k != "test_size"})
    if "test_size" in metrics:
        tracker.log_params({"data.test_size": int(metrics["test_size"])})
    return metrics


def _close_records(setup: Setup, tracker: Any, rec: record.Recorder, result: TrainResult, listeners: Listeners,
                   checkpoints: dict[str, Any]) -> None:
    """Summary metrics, the records beyond metrics (figures, model), mpsrun's own timings, the notes as tags.

    mpsrun's bookkeeping (what logging, figures, the model and checkpoints cost; the best epoch)
    goes to one artifact, `mpsrun_timings.json`, not to MLflow metrics: the UI draws a chart per
    metric, and prefixed sections come before the unprefixed one, so 14 bookkeeping charts stood
    between a user and their losses on the run's "Model metrics" tab. The summary's timings go to
    `system/` (the System metrics tab) and its `final_*` copies are left out (track/records/names.py).
    """
    recipe = setup.resolved.recipe
    t0 = time.perf_counter()
    tracker.log_metrics(mlflow_names.to_mlflow(result.summary()))
    errors = tracker.flush()
    book: dict[str, Any] = {
        "end_flush_time_s": time.perf_counter() - t0,
        "mlflow_log_time_s": tracker.log_time_s,
        "mlflow_log_time_during_training_s": tracker.log_time_during_s,
        "mlflow_handoff_time_s": tracker.handoff_time_s,
        **({"mlflow_setup_wait_s": tracker.setup_wait_s} if hasattr(tracker, "setup_wait_s") else {}),
    }
    t0 = time.perf_counter()
    for note in record.finish(rec, result):  # figures, description, the logged (and registered) model
        listeners.on_note(note)
        setup.notes.append(note)
    book["end_records_time_s"] = time.perf_counter() - t0  # figures and model, with the helper's share waited for
    book.update(rec.timings)
    book.update(checkpoints)
    tracker.log_text(bookkeeping(book), TIMINGS_FILE)
    tracker.set_tags({**setup.options.as_params(), "mpsrun.notes": " | ".join(setup.notes + setup.options.notes) or "none"})
    if errors:
        tracker.set_tags({"mpsrun.logging_errors": " | ".join(errors)})
    if not recipe.tracking.log_model:
        tracker.set_tags({"mpsrun.model_artifact": "skipped (tracking.log_model: false)"})


def _unwrap(model: nn.Module) -> nn.Module:
    return distributed.unwrap(model)  # torch.compile's and DDP's wrappers off


def run(resolved: Resolved, tracking_uri: str | None = None, listener: Listener | None = None) -> RunSummary:
    """Prepare and execute one recipe."""
    return execute(prepare(resolved), tracking_uri, listener)
