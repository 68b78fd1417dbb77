"""Export the logged model ahead, in a process of its own, while the run trains.

Why: the end of a run used to export the trained model with `torch.export` in the
training process, after the last epoch: importing `torch.export._trace` and tracing cost
about 1.9 s of a 10-epoch fashion run on the H100 machine (1.1 s on the 2-core one), a
second or two every user waits for and no plain script pays. A model's graph does not
depend on its weights, so the exporter (`python -m mpsrun.track.helper.exporter`),
started with the MLflow helper before torch is imported, imports torch and torch.export
on a core of its own, exports a CPU copy of the untrained model as soon as it is built,
and at the end only swaps the trained weights into the exported program and saves it.

The drawer (`python -m mpsrun.track.helper.exporter --draw`, the same code in another role)
imports matplotlib (not torch) and draws a throw-away figure as the run starts, then draws
the end-of-run prediction figures as PNG files that the helper only has to log, while the
helper draws the learning curves and writes the model. Both used to be the exporter's work
after its export: on the H100 machine its imports (torch, torch.export) and the export took
about as long as the run's set-up and training, so the figures' warm-up (0.85 s) made the end
of the run wait for the exporter (log_model 1.05 s, of which the helper's own work 0.55 s).

It is an optimisation, never a second source of truth: the end compares the final
model with the one exported ahead (module types, plain attributes, state_dict names,
shapes and dtypes, buffers outside the state_dict, the input transform) and exports
again where anything but the weights changed; any failure (the model does not
unpickle there, the exporter died or is too slow) sends the run back to exporting in
its own process, said in the run's notes. Which path served is tagged
(`mpsrun.model_export`).

Default (`MPSRUN_EXPORT_AHEAD=auto`): on with 4 or more usable cores for a run on a GPU,
8 for one on the CPU. On two cores a third process importing torch beside the training
process and the MLflow helper slows the start of the run more than the export costs at its
end; on the CPU its work shares the training's cores.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mpsrun.track.helper.pipe import decode, read_exact, receive, send

ENV = "MPSRUN_EXPORT_AHEAD"  # auto | 1 | 0
WAIT_ENV = "MPSRUN_EXPORT_AHEAD_WAIT_S"  # the most the end of a run waits for the exporter (default 300)
MIN_CORES = 4  # a run on a GPU
MIN_CORES_CPU = 8  # a run on the CPU


DRAW_ARG = "--draw"  # the process is a drawer: figures only, no torch
MAX_ENV = "MPSRUN_EXPORT_AHEAD_MAX_MB"  # larger models are exported at the end (default 1024)


def max_bytes() -> int:
    """The largest model (parameters and buffers) handed to the exporter before training."""
    try:
        return int(float(os.environ.get(MAX_ENV, "1024")) * 2**20)
    except ValueError:
        return 1024 * 2**20


class ExportAheadFailed(Exception):
    """The exporter could not give the pt2 file: the run exports in its own process instead."""


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def wanted(accelerator: bool = True) -> tuple[bool, str]:
    """(start an exporter?, why), from $MPSRUN_EXPORT_AHEAD, the usable cores and where the run trains.

    `accelerator`: the run will likely train on a GPU (its recipe's device, read before torch is
    imported). A CPU run needs more cores: there the exporter's second of work shares the cores the
    training's own threads use, and the epoch times it reports should stay the training's own.
    """
    raw = os.environ.get(ENV, "auto").strip().lower()
    if raw in ("1", "on", "true", "yes"):
        return True, f"{ENV}={raw}"
    if raw in ("0", "off", "false", "no"):
        return False, f"{ENV}={raw}"
    # A value that is none of these is taken as auto, and said in the reason (tagged mpsrun.model_export), not silently.
    bad = "" if raw == "auto" else f" ({ENV}={raw!r} is not 1, 0 or auto: taken as auto)"
    cores, need = _cores(), MIN_CORES if accelerator else MIN_CORES_CPU
    where = "" if accelerator else " for a CPU run"
    if cores >= need:
        return True, f"auto: {cores} cores{where}{bad}"
    return False, (f"auto: {cores} cores{where}, fewer than {need} (a third process importing torch would slow the run's "
                   f"start more than it saves at the end; {ENV}=1 forces it){bad}")


def start_ahead(export: bool, draw: bool, accelerator: bool = True) -> tuple["Exporter | None", "Exporter | None", str, str]:
    """(exporter, drawer, why, why not drawer) for a run that logs its model (`export`) and draws its figures
    (`draw`), where `wanted` says a process beside the training pays. The reasons are tagged on the run
    (`mpsrun.model_export`, `mpsrun.figures`); the drawer's is empty where it started."""
    wanted_, why = wanted(accelerator)
    exporter = drawer = None
    draw_why = "" if wanted_ else why
    if wanted_ and export:
        try:
            exporter = Exporter()
        except OSError as e:
            why = f"the exporter process did not start ({e})"
    if wanted_ and draw:
        try:
            drawer = Exporter(draw_only=True)
        except OSError as e:
            draw_why = f"the drawer process did not start ({e})"
    return exporter, drawer, why, draw_why


class Exporter:
    """The training process's side: start the exporter, hand it the model twice, take the pt2 file.

    `draw_only`: start a drawer instead, which takes `draw` (the end-of-run figures) and nothing else.
    """

    def __init__(self, draw_only: bool = False) -> None:
        self.dir = tempfile.mkdtemp(prefix="mpsrun-draw-" if draw_only else "mpsrun-export-")
        self.log = os.path.join(self.dir, "exporter.log")
        self.begun = False
        self.role = "drawer" if draw_only else "exporter"  # in what its failures say
        self.waited_s = 0.0
        with open(self.log, "wb") as err:
            # Own session: a Ctrl-C at the terminal is the training process's to handle; an exporter
            # whose parent is gone reads the end of its stdin and exits. One thread: it must not take
            # cores from the training it runs beside.
            self.proc = subprocess.Popen([sys.executable, "-m", "mpsrun.track.helper.exporter", *([DRAW_ARG] if draw_only else [])], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, start_new_session=True, bufsize=0,
                                         env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})

    def begin(self, served: Any, example: Any) -> None:
        """Hand over the untrained CPU copy and the input example; returns at once (the exporter works meanwhile)."""
        import torch

        path = os.path.join(self.dir, "begin.pt")
        torch.save({"served": served, "example": example}, path)  # a file: a pipe would block on a large model
        self._send(("begin", path))
        self.begun = True

    def finish(self, served: Any, folder: str) -> tuple[str, dict[str, Any]]:
        """The trained model's pt2 file in `folder`, and how it was made; raises ExportAheadFailed."""
        import torch

        if not self.begun:
            raise ExportAheadFailed("the model was not handed to the exporter before training")
        path = os.path.join(self.dir, "finish.pt")
        torch.save({"served": served}, path)
        t0 = time.perf_counter()
        try:
            self._send(("finish", path, folder))
            ok_begin, began = self._receive()
            ok, value = self._receive()
        finally:
            self.waited_s = time.perf_counter() - t0
        if not ok:
            raise ExportAheadFailed(value if ok_begin else began)
        pt2, info = value
        info["began_s"] = began.get("export_s") if isinstance(began, dict) else None
        return pt2, info

    def draw(self, figures: tuple) -> None:
        """Ask a drawer for the end-of-run figures (`figures.draw_end`'s arguments but the folder: history, title, predictions,
        classes, curves); `figures_result` reads them."""
        path = os.path.join(self.dir, "figures.pkl")
        with open(path, "wb") as f:
            pickle.dump(figures, f, protocol=pickle.HIGHEST_PROTOCOL)
        folder = os.path.join(self.dir, "figures")
        os.makedirs(folder, exist_ok=True)
        self._send(("figures", path, folder))

    def figures_result(self) -> dict[str, Any]:
        """What `draw` asked for: `figures.draw_end`'s answer (files under this exporter's folder until `close`)."""
        ok, value = self._receive()
        if not ok:
            raise ExportAheadFailed(value)
        return value

    def close(self) -> None:
        """End the exporter (or drawer) and remove its files (safe to call twice). It holds nothing worth a clean
        exit: killed, so that no run waits for a torch process to tear itself down (half a second on the H100 machine)."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None and proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def _send(self, msg: tuple) -> None:
        try:
            send(self.proc.stdin, msg)  # type: ignore[arg-type]
        except (BrokenPipeError, OSError) as e:
            raise ExportAheadFailed(f"the {self.role} process ended ({self._last_words() or e})") from None

    def _receive(self) -> Any:
        deadline = time.monotonic() + float(os.environ.get(WAIT_ENV, "300"))

        def stalled() -> str | None:
            if time.monotonic() > deadline:
                self.proc.kill()
                return f"no answer within {os.environ.get(WAIT_ENV, '300')} s ({WAIT_ENV}); killed"
            return None

        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        try:
            return decode(lambda n: read_exact(fd, n, stalled))
        except (EOFError, OSError) as e:
            code = self.proc.poll()
            raise ExportAheadFailed(f"the {self.role} process ended (exit {code}): {self._last_words() or e}") from None

    def _last_words(self) -> str:
        try:
            lines = [ln for ln in Path(self.log).read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""


# -- the exporter process


def fingerprint(served: Any) -> bytes | None:
    """What, besides the weights' values, decides the exported graph; None when it cannot be told.

    Module types and their plain attributes (training flags, sizes, anything a forward may read),
    state_dict names, shapes and dtypes, buffers outside the state_dict with their values, and the
    input transform. Two fingerprints are compared in the same process (the same hash seed).
    """
    try:
        parts: list[Any] = []
        for name, m in served.named_modules():
            plain = {k: v for k, v in vars(m).items() if not k.startswith("_")}
            parts.append((name, type(m).__module__, type(m).__qualname__, pickle.dumps(plain)))
        sd = served.state_dict()
        parts.append([(k, tuple(v.shape), str(v.dtype)) for k, v in sd.items()])
        parts.append([(n, pickle.dumps(b.detach().cpu())) for n, b in served.named_buffers() if n not in sd])
        return pickle.dumps(parts)
    except Exception:  # noqa: BLE001 - something that does not pickle: export again at the end
        return None


def _begin(path: str) -> dict[str, Any]:
    import torch

    from mpsrun.track.records import model_log

    loaded = torch.load(path, map_location="cpu", weights_only=False)
    served, example = loaded["served"], loaded["example"]
    seen = fingerprint(served)  # before the export runs it: a transform may cache tensors on first use
    t0 = time.perf_counter()
    program = model_log.export_program(served, example)
    export_s = time.perf_counter() - t0
    import io

    torch.export.save(program, io.BytesIO())  # the serializer's first call is slow: paid here, not at the end
    return {"example": example, "program": program, "print": seen, "export_s": export_s}


def _warm_figures() -> None:
    """Import matplotlib and draw a tiny figure (fonts loaded): the drawer's start, while the run sets up."""
    try:
        import io

        from mpsrun.track.records import figures

        figures.learning_curves([{"train_loss": 1.0, "val_loss": 1.0, "val_accuracy": 0.5}], "warm-up").savefig(io.BytesIO(), format="png")
    except Exception:  # noqa: BLE001 - the figures request reports its own failure
        pass


def _figures(path: str, folder: str) -> dict[str, Any]:
    from mpsrun.track.records import figures

    with open(path, "rb") as f:
        history, title, predictions, classes, curves = pickle.load(f)
    return figures.draw_end(history, title, predictions, classes, folder, curves)


def _finish(state: dict[str, Any], path: str, folder: str) -> tuple[str, dict[str, Any]]:
    import torch

    from mpsrun.track.records import model_log

    final = torch.load(path, map_location="cpu", weights_only=False)["served"]
    t0 = time.perf_counter()
    program, why = state["program"], ""
    now = fingerprint(final)
    sd = final.state_dict()
    if now is None or now != state["print"]:
        why = "the model changed beyond its weights during training" if now is not None else "the model's attributes cannot be compared"
    elif set(program.state_dict) != set(sd):
        why = "the exported program's weights are not named as the model's"
    if why:
        program = model_log.export_program(final, state["example"])
    else:
        with torch.no_grad():
            for k, target in program.state_dict.items():
                target.copy_(sd[k])
    out = Path(folder) / "model.pt2"
    torch.export.save(program, str(out))
    return str(out), {"how": "again" if why else "ahead", "why": why, "finish_s": time.perf_counter() - t0}


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to the log, never into the reply pipe
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    t0 = time.perf_counter()
    draw_only = DRAW_ARG in sys.argv[1:]
    if draw_only:  # ready for the end's figures long before the run ends; torch is never imported here
        _warm_figures()
    else:
        import torch

        torch.set_num_threads(1)
        import torch.export._trace  # noqa: F401 - the import is most of an export's first second

        from mpsrun.track.records import model_log  # noqa: F401

    print(f"{'drawer' if draw_only else 'exporter'}: imports done in {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
    state: dict[str, Any] | None = None
    began_error = "the model was never handed over"
    folder = ""  # the training process's folder for this exporter: removed here if that process dies first
    while True:
        try:
            msg = receive(requests)
        except EOFError:  # the training process ended; a killed one could not remove the model copy it wrote
            if os.path.basename(folder).startswith(("mpsrun-export-", "mpsrun-draw-")):
                shutil.rmtree(folder, ignore_errors=True)
            return 0
        folder = os.path.dirname(msg[1])
        try:
            if draw_only and msg[0] != "figures":
                send(reply, (False, f"a drawer does not {msg[0]}"))
            elif msg[0] == "begin":
                state = None
                try:
                    state = _begin(msg[1])
                except Exception as e:  # noqa: BLE001 - said at the end, where the run exports itself instead
                    began_error = f"exporting ahead failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
                    send(reply, (False, began_error))
                else:
                    send(reply, (True, {"export_s": state["export_s"]}))
            elif msg[0] == "finish":
                if state is None:
                    send(reply, (False, began_error))
                    continue
                try:
                    send(reply, (True, _finish(state, msg[1], msg[2])))
                except Exception as e:  # noqa: BLE001
                    send(reply, (False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
                state = None
            elif msg[0] == "figures":
                try:
                    send(reply, (True, _figures(msg[1], msg[2])))
                except Exception as e:  # noqa: BLE001
                    send(reply, (False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
        except (BrokenPipeError, OSError):
            return 0


if __name__ == "__main__":
    sys.exit(main())
