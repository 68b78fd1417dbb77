"""MLflow set-up beside the rest of start-up: a helper process (default), a thread, or inline.

Why: importing mlflow and opening its SQLite store (SQLAlchemy engine, alembic
schema checks) took 8.9 s of a 19 s run on the H100 machine and about a second
and a half on a 2-core CPU, all of it before the first training step, none of it
needed until the run is created. `start` begins that work as soon as the tracking
URI and experiment are known, and `BackgroundTracker` is a drop-in for
`store.Tracker` whose first call waits for it to finish, so it overlaps the torch
import, data loading and model building.

Thread or process: an import is Python bytecode run under the GIL, so a thread
importing mlflow mostly takes turns with the main thread importing torch. A helper
process (`python -m mpsrun.track.helper.process`) runs on another core and the main
process never imports mlflow at all; every Tracker call becomes a round trip over
a pipe (about a tenth of a millisecond, outside the step loop: per epoch at most).
`benchmarks/wall.py --helpers` measures the three side by side.

Mode: `MPSRUN_MLFLOW_HELPER=process|thread|inline|auto` (default auto: process; thread
on MPS, where the system-metrics monitor reads torch.mps memory of the training process
itself). The run's record hooks (train/record.py -> track/records/hooks.py: dataset inputs,
system metrics, figures, the logged model) run in the helper too, fed plain data and a
file holding the trained model. The mode is tagged on the run (`mpsrun.mlflow_helper`)
and the time the main thread waited for set-up is logged (`mlflow_setup_wait_s`). A
set-up failure is raised, with its original message, from the first call that needs
the run: `TrackingSetupError`.

A helper that dies mid-run does not take the run with it: the first call that finds
it gone opens the store in this process (a `store.Tracker`, as thread mode would),
continues the same run and writes again every metric handed over so far (same step,
same timestamp: MLflow keeps one copy of an identical metric), says so in a note
(`mpsrun.mlflow_helper` gains "helper died ..."), and the run goes on.
"""

from __future__ import annotations

import inspect
import os
import platform
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable

from mpsrun.track.store import client as store
from mpsrun.track.helper.pipe import _HelperGone, _Remote, _RemoteError

ENV_MODE = "MPSRUN_MLFLOW_HELPER"
MODES = ("auto", "process", "thread", "inline")


def _tracker_method(name: str) -> bool:
    """Whether `name` is a plain method of the helper's `store.Tracker` (known here, without asking it)."""
    return isinstance(inspect.getattr_static(store.Tracker, name, None), types.FunctionType)


class TrackingSetupError(Exception):
    """MLflow could not be set up (bad URI, unreachable server, broken store): bad input, exit 2."""


def choose_mode(requested: str | None = None) -> tuple[str, str]:
    """(mode, why) from the argument, else $MPSRUN_MLFLOW_HELPER, else auto."""
    raw = (requested or os.environ.get(ENV_MODE) or "auto").strip().lower()
    if raw not in MODES:
        raise TrackingSetupError(f"{ENV_MODE}={raw!r} is not one of {', '.join(MODES)}")
    if raw != "auto":
        return raw, f"{ENV_MODE}={raw}" if not requested else "requested"
    return "process", "auto"


def may_run_on_mps(device: str | None) -> bool:
    """Whether a recipe's `device` can end up on MPS here (known before torch is imported)."""
    return platform.system() == "Darwin" and (device or "auto").split(":")[0] in ("mps", "auto")


def start(uri: str, experiment: str, artifact_root: str | None = None, mode: str | None = None, device: str | None = None,
          keep_open: bool = False, export_ahead: bool = False, accelerator: bool = True, warm: str | None = None,
          draw_ahead: bool = False) -> "BackgroundTracker":
    """Begin MLflow set-up now (import, client, store checks, experiment look-up); returns at once.

    `device`: the recipe's; auto mode keeps the tracker in this process where it may be MPS.
    `keep_open`: runs one after another (`close()` when done), as a sweep's worker does.
    `export_ahead`: the run logs a model: start the exporter process too, where it pays
    (track/helper/exporter.py); `accelerator`: the run will likely train on a GPU. `warm`: "begin" when
    the runs log no model and no figures (a sweep's trials): the helper imports only what `begin` needs.
    `draw_ahead`: the run draws the end-of-run figures: start a drawer process too, where an exporter would pay.
    """
    return BackgroundTracker(uri, experiment, artifact_root, mode, device, keep_open, export_ahead, accelerator, warm, draw_ahead)


class BackgroundTracker:
    """A `store.Tracker` whose set-up runs in the background; same methods, same records.

    Before `start` nothing is written: the experiment is only looked up, so bad input
    found while preparing (exit 2) leaves no run and no experiment behind (`close()`).
    """

    def __init__(self, uri: str, experiment: str, artifact_root: str | None = None, mode: str | None = None, device: str | None = None,
                 keep_open: bool = False, export_ahead: bool = False, accelerator: bool = True, warm: str | None = None,
                 draw_ahead: bool = False) -> None:
        self.uri, self.experiment, self.artifact_root = uri, experiment, artifact_root
        self.keep_open = keep_open  # one run after another in the same helper (a sweep's worker): `finish` leaves it running
        self.mode, self.mode_reason = choose_mode(mode)
        if self.mode == "process" and self.mode_reason == "auto" and may_run_on_mps(device):
            self.mode, self.mode_reason = "thread", "auto: on MPS the system metrics read torch.mps memory of the training process"
        self.setup_wait_s = 0.0  # time the caller waited for set-up at `start`
        self.wait_s = 0.0  # time the caller waited for the helper's answers, all runs (a sweep's trace reads it)
        self._t0 = time.perf_counter()
        self._tracker: store.Tracker | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._remote: _Remote | None = None
        self._handoff_s = 0.0
        self._final: dict[str, Any] | None = None
        self._client: Any = None
        self._run_id: str | None = None
        self._journal: list[tuple[dict[str, float], int | None, int]] = []  # metrics handed to the helper, for a helper that dies
        self._tags: dict[str, str] = {}
        if self.mode == "thread":
            self._thread = threading.Thread(target=self._warm, name="mpsrun-mlflow-setup", daemon=True)
            self._thread.start()
        elif self.mode == "process":
            self._remote = _Remote(uri, experiment, artifact_root, warm)
        self._exporter: Any = None
        self._drawer: Any = None  # the drawer process (track/helper/exporter.py), until the end figures are asked for
        self._export_asked = export_ahead  # `mpsrun run` (tagged mpsrun.model_export), not a sweep's worker
        self._drawing: Any = None  # the drawer once the end figures are asked for
        self._artifact_uri: str | None = None  # the run's, read once at `start`
        self.export_why = "" if export_ahead else "no exporter process: `mpsrun run` starts one"
        self.draw_why = "" if draw_ahead else "no drawer process: `mpsrun run` starts one"  # where there is none: why
        if export_ahead or draw_ahead:
            from mpsrun.track.helper import exporter

            self._exporter, self._drawer, export_why, draw_why = exporter.start_ahead(export_ahead, draw_ahead, accelerator)
            self.export_why, self.draw_why = export_why or self.export_why, draw_why or self.draw_why

    # -- set-up
    def _warm(self) -> None:
        """Import mlflow and open the store (cached by MLflow per URI), read-only."""
        try:
            store.client(self.uri).get_experiment_by_name(self.experiment)
        except BaseException as e:  # reported from `start`, never swallowed
            self._error = e

    def _ready(self) -> store.Tracker | None:
        """Wait for set-up; the in-process Tracker (thread/inline) or None (process)."""
        if self._tracker is not None or self._remote is not None:
            return self._tracker
        t = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._error is not None:
                raise self._error
            self._tracker = store.Tracker(self.uri, self.experiment, self.artifact_root)
        except BaseException as e:
            raise TrackingSetupError(f"MLflow set-up failed for {self.uri}: {type(e).__name__}: {e}") from e
        finally:
            self.setup_wait_s += time.perf_counter() - t
        return self._tracker

    # -- the helper process, and what happens when it is gone
    def _call(self, method: str, *args: Any) -> Any:
        """One call: in the helper while it lives, else on the in-process Tracker that replaced it."""
        if self._remote is not None:
            t = time.perf_counter()
            try:
                return self._remote.call(method, *args)
            except _HelperGone as e:
                self._take_over(e)
            finally:
                self.wait_s += time.perf_counter() - t
        return getattr(self._need(), method)(*args)

    def _post(self, method: str, *args: Any) -> None:
        """A call whose answer nobody waits for (a failure is raised by the next call that waits)."""
        if self._remote is not None:
            try:
                self._remote.post(method, *args)
                return
            except _HelperGone as e:
                self._take_over(e)
        getattr(self._need(), method)(*args)

    def _take_over(self, why: BaseException) -> None:
        """The helper died: open the store here, continue the same run, write every metric again."""
        remote, self._remote = self._remote, None
        redo = remote.unconfirmed() if remote is not None else []
        if remote is not None:
            remote.close(wait=False)
        self.mode, self.mode_reason = "inline", f"process helper died ({why}); the store was opened in the training process"
        tracker = self._ready()
        assert tracker is not None
        if self._run_id is None:
            return
        tracker.attach(self._run_id)
        tracker.set_tags({**self._tags, "mpsrun.mlflow_helper": f"process (helper died: {why}); went on in the training process"})
        for metrics, step, ts in self._journal:  # identical (key, value, step, timestamp): stored once
            tracker.log_metrics(metrics, step, ts)
        for method, args in redo:  # posted, perhaps never written: tags, params and texts are idempotent
            if method != "log_metrics":
                getattr(tracker, method)(*args)
        tracker.sync()

    # -- the Tracker surface the runner uses; anything else is forwarded by __getattr__
    def start(self, run_name: str | None, tags: dict[str, str], parent_run_id: str | None = None) -> store.RunInfo:
        self._journal, self._handoff_s, self._final, self._run_id = [], 0.0, None, None  # a run of its own (keep_open: not the first)
        self._artifact_uri = None
        tags = {**tags, "mpsrun.mlflow_helper": f"{self.mode} ({self.mode_reason})"}
        self._tags = tags
        tracker = self._ready()
        if tracker is not None:
            return tracker.start(run_name, tags, parent_run_id)
        assert self._remote is not None
        t = time.perf_counter()
        try:
            info = self._remote.call("start", run_name, tags, parent_run_id)
        except _HelperGone as e:  # died before the run began: set up here instead
            self._take_over(e)
            self._tags = tags = {**tags, "mpsrun.mlflow_helper": f"process (helper died before the run began: {e}); in the training process"}
            return self._need().start(run_name, tags, parent_run_id)
        except _RemoteError as e:
            raise TrackingSetupError(f"MLflow set-up failed for {self.uri}: {e}") from None
        finally:
            self.setup_wait_s += time.perf_counter() - t
            self.wait_s += time.perf_counter() - t
        self._run_id = info.run_id
        try:  # asked now, while nothing is queued before it (checkpoints are written there)
            self._artifact_uri = self._remote.kind("artifact_uri")[1]
        except _RemoteError:
            self._artifact_uri = None
        return info

    @property
    def run_id(self) -> str | None:
        if self._remote is None and self._tracker is not None:
            return self._tracker.run_id
        return self._run_id

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, timestamp_ms: int | None = None) -> None:
        if self._remote is None:
            return self._need().log_metrics(metrics, step, timestamp_ms)
        t = time.perf_counter()
        entry = ({k: float(v) for k, v in metrics.items()}, step, timestamp_ms or int(time.time() * 1000))
        self._journal.append(entry)
        self._post("log_metrics", *entry)
        self._handoff_s += time.perf_counter() - t

    def set_tags(self, tags: dict[str, str]) -> None:
        if self._remote is None:
            return self._need().set_tags(tags)
        self._post("set_tags", {k: str(v) for k, v in tags.items()})

    def log_params(self, params: dict[str, Any]) -> None:
        if self._remote is None:
            return self._need().log_params(params)
        self._post("log_params", params)

    def log_text(self, text: str, name: str) -> None:
        if self._remote is None:
            return self._need().log_text(text, name)
        self._post("log_text", text, name)

    def hook_later(self, name: str, *args: Any) -> Callable[[], Any]:
        """A record hook started now, its answer read when asked for (the helper draws while this process exports).

        The end-of-run figures: by the drawer process where there is one (track/helper/drawing.py)."""
        if name == "end_figures":
            from mpsrun.track.helper import drawing

            drawer, self._drawer = self._drawer, None
            self._drawing = drawer  # closed with the run, whatever happens to the figures
            return drawing.start(self, drawer, self.draw_why, args)
        return self.later(name, *args)

    def later(self, name: str, *args: Any) -> Callable[[], Any]:
        """`hook_later` in the helper as it is, whatever the hook."""
        if self._remote is not None:
            try:
                p = self._remote.post("hook", name, *args)
            except _HelperGone as e:
                self._take_over(e)
            else:
                def answer() -> Any:
                    t = time.perf_counter()
                    try:
                        return p.result()
                    except _HelperGone as e:
                        self._take_over(e)
                        return self._need().hook(name, *args)
                    finally:
                        self.wait_s += time.perf_counter() - t
                return answer
        value = self.hook(name, *args)
        return lambda: value

    @property
    def handoff_time_s(self) -> float:
        """Time the training thread spent handing metrics over (the pipe round trip, in process mode)."""
        if self._remote is None and self._run_id is None:
            return self._need().handoff_time_s
        return self._handoff_s + (self._tracker.handoff_time_s if self._tracker is not None else 0.0)

    def model_ahead(self, make: Callable[[], tuple[Any, Any]], nbytes: int = 0) -> None:
        """Hand the exporter process the untrained model (`make()`: a CPU served copy and the input
        example) so that it exports while the run trains; nothing without an exporter.

        `nbytes`: the model's parameters and buffers. Above the exporter's limit the copy (written to a
        file before training) would cost the start more than the export costs the end: not handed over."""
        if self._exporter is None:
            return
        from mpsrun.track.helper.exporter import max_bytes

        if nbytes > max_bytes():
            self._exporter.close()
            self._exporter, self.export_why = None, f"the model's {nbytes / 2**20:,.0f} MiB is above {max_bytes() / 2**20:,.0f} MiB (MPSRUN_EXPORT_AHEAD_MAX_MB)"
            return
        try:
            self._exporter.begin(*make())
        except Exception as e:  # noqa: BLE001 - the end of the run exports in this process, and says why
            self._exporter.close()
            self._exporter, self.export_why = None, f"the model could not be handed to the exporter ({type(e).__name__}: {e})"

    def _log_model_ahead(self, served: Any, example: Any, rest: tuple) -> Any:
        """`log_model` from the exporter's pt2 file; None (with `export_why` set) where it cannot serve."""
        import tempfile

        import torch

        from mpsrun.track.helper.exporter import ExportAheadFailed
        from mpsrun.track.records import model_log

        exporter, self._exporter = self._exporter, None
        try:
            with tempfile.TemporaryDirectory(prefix="mpsrun-model-") as d:
                try:
                    pt2, info = exporter.finish(served, d)
                except ExportAheadFailed as e:
                    self.export_why = f"the exporter could not serve: {e}"
                    return None
                outputs = model_log.example_outputs(served, example)
                out = self._hook_here("log_exported", pt2, example, outputs, str(torch.__version__), *rest)
        finally:
            exporter.close()
        began = f"exported while training ({info['began_s']:.2f} s)" if info.get("began_s") is not None else "exported while training"
        if info["how"] == "ahead":
            how = f"ahead: {began} in a process of its own; the trained weights swapped in at the end (waited {exporter.waited_s:.2f} s)"
        else:
            how = f"again at the end in the exporter process ({info['why']}; waited {exporter.waited_s:.2f} s)"
        self.set_tags({"mpsrun.model_export": how})
        return out

    def hook(self, name: str, *args: Any) -> Any:
        """A record hook (`track.hooks`): in the helper, a model handed over as a file (torch.save)."""
        if name == "log_model" and self._exporter is not None:
            out = self._log_model_ahead(args[0], args[1], args[2:])
            if out is not None:
                return out
            out = dict(self._hook_here(name, *args))  # the exporter could not serve: exported here, said
            out["notes"] = [*out.get("notes", []), f"model: not exported ahead ({self.export_why}); exported at the end of the run instead"]
            self.set_tags({"mpsrun.model_export": f"at the end of the run ({self.export_why})"})
            return out
        if name == "log_model" and self._export_asked:
            self.set_tags({"mpsrun.model_export": f"at the end of the run ({self.export_why or 'no exporter process'})"})
        return self._hook_here(name, *args)

    def _hook_here(self, name: str, *args: Any) -> Any:
        if self._remote is None:
            return self._need().hook(name, *args)
        if name != "log_model":
            return self._call("hook", name, *args)
        import tempfile

        import torch

        from mpsrun.track.records import model_log

        served, example, rest = args[0], args[1], args[2:]
        with tempfile.TemporaryDirectory(prefix="mpsrun-model-") as d:
            try:  # exported here, where torch._dynamo is loaded; the helper writes the MLflow model around the file
                pt2, outputs = model_log.export_pt2(served, example, d)
            except Exception:  # noqa: BLE001 - torch.export cannot trace it: the helper tries again, then pickles (with a note)
                path = str(Path(d) / "served.pt")
                torch.save(served, path)
                return self._call("hook", name, path, example, *rest)
            return self._call("hook", "log_exported", pt2, example, outputs, str(torch.__version__), *rest)

    def log_state_dict(self, state: dict[str, Any], name: str = "model.pt") -> None:
        if self._remote is None:
            return self._need().log_state_dict(state, name)
        import tempfile

        import torch

        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / name
            torch.save({k: v.detach().cpu() for k, v in state.items()}, p)
            self._call("log_file", str(p), None)

    def finish(self, status: str, error: BaseException | None = None) -> None:
        self._close_exporter()  # a run that ended before its model and figures were logged
        if self._remote is None:
            self._need().finish(status, error)
            return
        if error is None:
            self._call("finish_text", status)
        else:
            import traceback

            tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            self._call("finish_text", status, f"{type(error).__name__}: {error}", tb)
        if self._remote is None:  # the helper died on the way: finished here
            return
        if self.keep_open:  # the next run starts in the same helper; its figures stay readable live
            return
        try:
            self._final = self._remote.values()  # log_time_s and friends stay readable after the helper ends
        except _RemoteError:
            self._final = {}
        # finish_text has answered, so the run is written and marked; the helper's own exit
        # (tearing down mlflow and SQLAlchemy) need not hold up this process's.
        self.close(wait=False)

    def close(self, wait: bool = True) -> None:
        """Stop the helper (it writes what it holds, then exits) and the exporter; safe to call twice.

        `wait=False` when abandoning before `start` (bad input): nothing is held, and
        the helper finishes its read-only set-up and exits on its own.
        """
        self._close_exporter()
        if self._remote is not None:
            self._remote.close(wait)

    def _close_exporter(self) -> None:
        for exporter in (self._exporter, self._drawer, self._drawing):
            if exporter is not None:
                exporter.close()
        self._exporter = self._drawer = self._drawing = None

    def _need(self) -> store.Tracker:
        tracker = self._ready()
        assert tracker is not None
        return tracker

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._remote is None:
            return getattr(self._need(), name)
        if name == "c":  # MLflow's client, for code that calls it directly: one of this process's own (imports mlflow)
            if self._client is None:
                self._client = store.client(self.uri)
            return self._client
        if self._final is not None and name in self._final:
            return self._final[name]
        if name == "artifact_uri" and self._artifact_uri is not None:
            return self._artifact_uri
        if _tracker_method(name):  # no round trip to ask: it would wait for every call posted before (a dataset's digest)
            if name == "attach":  # another run: its artifact URI is asked again
                self._artifact_uri = None
            return lambda *a: self._call(name, *a)
        try:
            kind = self._remote.kind(name)
        except _HelperGone as e:
            self._take_over(e)
            return getattr(self._need(), name)
        if kind[0]:
            return lambda *a: self._call(name, *a)
        return kind[1]
