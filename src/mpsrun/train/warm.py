"""Work a CUDA run would do on its training thread, started on threads while the run prepares.

Both are paid once per process, and both mostly wait on something other than the interpreter, so
beside the set-up's own waits (the CUDA context, the data's decompression, copies to the GPU) they
cost the run little of what they cost on its path:

- `dynamo()`: import torch._dynamo. torch's optimizers import it when they are built (their methods
  are wrapped to be skipped by torch.compile): 4 to 6 s of the fashion run's set-up in a py-spy
  profile on the H100 machine, the largest single step of its start. An import holds the
  interpreter lock for its bytecode, so the thread gains only what the set-up leaves idle; the
  optimizer's own import then waits for the thread's (one module lock), never imports twice.
  While it is still under way when the model is on the GPU (`dynamo_pending()`), the main thread
  has seconds in which it would only wait: `in_the_wait()` runs the canary and the fused layers'
  first launches there (called by runner.prepare).
- `triton_key()`: the first Triton kernel a process launches computes `triton_key()`, a SHA-256 of
  Triton's sources and of its 500 MB `libtriton.so`, even when every kernel comes from the on-disk
  cache: 0.4 s of the fashion run's first epoch on the H100 machine. Reading the file and hashing it
  release the interpreter lock. `wait_triton()` as training starts keeps the training thread from
  computing it a second time beside the thread (Triton caches it with `functools.lru_cache`). The
  same thread then makes Triton's CUDA driver, whose C helpers are compiled with the system's C
  compiler the first time on a machine (a subprocess: no interpreter lock held).

Nothing here may run during training: a thread importing while the epochs ran slowed them on the
H100 (the step's launches wait for the lock). Both are done before the first step: the optimizer's
import waits for the thread's, and training begins with `wait_triton()`.
"""

from __future__ import annotations

import threading
from typing import Any

_triton: threading.Thread | None = None
_dynamo: threading.Thread | None = None


def dynamo() -> threading.Thread:
    """Import torch._dynamo on a thread (once per process); the thread, to join where its end matters."""
    global _dynamo
    if _dynamo is None:

        def imp() -> None:
            try:
                import torch._dynamo  # noqa: F401
            except Exception:  # noqa: BLE001 - the optimizer imports it again and meets the error there
                pass

        _dynamo = threading.Thread(target=imp, name="mpsrun-warm-dynamo", daemon=True)
        _dynamo.start()
    return _dynamo


def dynamo_pending() -> bool:
    """Whether the import of torch._dynamo started by `dynamo()` is still under way (the optimizer would wait)."""
    return _dynamo is not None and _dynamo.is_alive()


def triton_key() -> None:
    """Begin computing Triton's cache key (once per process; nothing where Triton is not importable)."""
    global _triton
    if _triton is not None:
        return

    def work() -> None:
        try:
            try:
                from triton.runtime.cache import triton_key as key
            except ImportError:  # older Triton kept it beside the compiler
                from triton.compiler.compiler import triton_key as key  # type: ignore[no-redef]
            key()
            from triton.runtime import driver

            driver.active.utils  # noqa: B018 - the driver's C helpers: built with the C compiler where Triton's cache is new
        except Exception:  # noqa: BLE001 - the first kernel computes it (or meets the error) as it would have
            pass

    _triton = threading.Thread(target=work, name="mpsrun-warm-triton", daemon=True)
    _triton.start()


def wait_triton() -> None:
    """Until Triton's key is known (at once where `triton_key` was not called)."""
    if _triton is not None:
        _triton.join()


def fused_layers(model: Any, batch_size: int) -> None:
    """Load the fused layers' Triton kernels now: a throw-away run of the check the capture makes first
    (`fused_linear.Planned.check`: copies of the weights, a private generator, nothing of the run's
    state touched). The first launch of each kernel reads it from Triton's cache and loads it on the
    GPU, 0.2-0.3 s of the fashion run's first epoch in a py-spy profile on the H100 machine; the
    runner calls this where the main thread would otherwise wait for torch._dynamo's import. A
    failure here is left to the capture's own check, which meets it again and says so.
    """
    wait_triton()  # the first launch computes Triton's key: once, on its thread
    from mpsrun.train.kernels import fused_linear

    try:
        fused_linear.plan(model).check(batch_size)
    except Exception:  # noqa: BLE001 - see above
        pass


def in_the_wait(recipe: Any, device: Any, model: Any, splits: Any, options: Any) -> Any:
    """What set-up does while the optimizer's constructor would wait for `dynamo()`'s import (nothing
    where it is done): the canary's report, or None where it did not run here.

    The optimizer imports torch._dynamo, which the thread is still importing: the main thread would only
    wait (seconds, on the H100 machine). The canary's device work releases the interpreter lock, so it
    runs here rather than on the run's path; `execute` records its report and stops the run on a
    failure as before. Its own time then includes waits for the lock the import holds (2.4-3.5 s on the
    H100 machine, all inside the import's): no budget note for it, the tag canary.when says where it
    ran. Then the fused layers' first launches (`fused_layers`), off the first epoch.
    """
    from mpsrun.devices import canary
    from mpsrun.train import assemble

    early = None
    if dynamo_pending() and canary.applies(device) and recipe.canary != "off":
        early = canary.check(recipe.canary, device, model, splits, options.channels_last)
        early.when = "during set-up, while torch._dynamo was imported on a thread"
    if dynamo_pending() and assemble.layers_why_not(model, device, options, recipe.batch_size) is None:
        fused_layers(model, recipe.batch_size)
    return early
