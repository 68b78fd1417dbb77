"""Work started on threads while a CUDA run prepares (train/warm.py): Triton's cache key, torch._dynamo's import.

Real Triton (it ships with CUDA torch wheels; skipped where absent): the key is computed on the
named thread and cached where the first kernel launch reads it."""

from __future__ import annotations

import pytest


def test_triton_key_is_hashed_on_a_thread_and_cached_for_the_first_kernel() -> None:
    pytest.importorskip("triton")
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        from triton.compiler.compiler import triton_key  # type: ignore[no-redef]
    from mpsrun.train import warm

    triton_key.cache_clear()
    warm._triton = None
    warm.triton_key()
    thread = warm._triton
    assert thread is not None and thread.name == "mpsrun-warm-triton"
    warm.triton_key()  # once per process
    assert warm._triton is thread
    warm.wait_triton()
    assert not thread.is_alive() and triton_key.cache_info().currsize == 1
    assert triton_key() and triton_key.cache_info().hits >= 1


def test_a_cuda_recipe_imports_dynamo_on_a_thread_before_its_optimizer(work) -> None:  # type: ignore[no-untyped-def]
    """A fresh interpreter (torch._dynamo not yet imported): preparing a recipe whose device may be CUDA
    starts the import on the named thread, and the optimizer it builds finds the module imported there."""
    import subprocess
    import sys

    code = """
import sys, threading, torch
if not torch.backends.cuda.is_built():
    print("no-cuda-build"); raise SystemExit
from mpsrun.plugins import resolve
from mpsrun.train import runner, warm
assert "torch._dynamo" not in sys.modules
seen = []
real = warm.dynamo
warm.dynamo = lambda: seen.append(real()) or seen[-1]
runner.prepare(resolve(sys.argv[1], ["device=auto", "epochs=1"]))
t = seen[0]
assert t.name == "mpsrun-warm-dynamo" and not t.is_alive() and "torch._dynamo" in sys.modules
runner.prepare(resolve(sys.argv[1], ["device=cpu", "epochs=1"]))  # an explicit CPU run starts none
assert len(seen) == 1
print("ok")
"""
    from .conftest import RECIPES

    p = subprocess.run([sys.executable, "-c", code, str(RECIPES / "digits_mlp.yaml")], cwd=work.path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    if p.stdout.strip() == "no-cuda-build":
        pytest.skip("torch without CUDA: no CUDA run, no warm-up thread")
    assert p.stdout.strip() == "ok", p.stdout


def test_the_run_end_drops_dynamos_compile_table_only_where_its_log_would_not_show() -> None:
    """`mpsrun run` ends with os._exit after the exit handlers (cli._end); torch._dynamo's table of
    compile times is built there only to be logged at INFO, hidden unless torch's logs are on.
    A fresh interpreter: the exit handlers really run."""
    import subprocess
    import sys

    code = """
import atexit, logging
import torch._dynamo.utils as utils
from mpsrun import cli
built = []
utils.compile_times = lambda *a, **k: built.append(1) or ""  # what dump_compile_times calls to build the table
utils.log.setLevel(logging.INFO)  # as TORCH_LOGS would: the table is shown, so it is built
cli._drop_silent_exit_work(atexit)
atexit._run_exitfuncs()
shown = len(built)
atexit.register(utils.dump_compile_times)  # run_exitfuncs cleared it
utils.log.setLevel(logging.WARNING)  # the default: nothing shown, nothing built
cli._drop_silent_exit_work(atexit)
atexit._run_exitfuncs()
print(shown, len(built))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["1", "1"], p.stdout


def test_gpu_a_cuda_run_loads_its_fused_kernels_and_runs_its_canary_while_the_optimizer_waits(work) -> None:  # type: ignore[no-untyped-def]
    """On a CUDA GPU (skipped elsewhere), a fresh interpreter whose torch._dynamo import is still under way
    (a thread that waits, standing in for it): set-up runs the canary and the fused layers' check, with
    their kernels' first launches, before the optimizer is built; the capture's own check then finds
    the kernels loaded."""
    import subprocess
    import sys

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    code = """
import sys, threading
from mpsrun.plugins import resolve
from mpsrun.train import runner, warm
from mpsrun.train.kernels import fused_linear
done = threading.Event()
warm._dynamo = threading.Thread(target=done.wait, daemon=True)
warm._dynamo.start()
order = []
check = fused_linear.Planned.check
fused_linear.Planned.check = lambda self, rows, **k: order.append(("check", rows, len(fused_linear._kernels))) or check(self, rows, **k)
build = runner.build_optimizer
runner.build_optimizer = lambda *a: order.append(("optimizer",)) or build(*a)
setup = runner.prepare(resolve(sys.argv[1], ["device=cuda", "epochs=1"]))
done.set()
assert setup.canary is not None and setup.canary.status == "passed" and setup.canary.when, setup.canary
assert setup.options.fused_linear, setup.notes
assert order[0] == ("check", 32, 0) and order[1] == ("optimizer",), order
assert fused_linear._kernels, "the kernels were built in set-up"
print("ok")
"""
    from .conftest import RECIPES

    p = subprocess.run([sys.executable, "-c", code, str(RECIPES / "digits_mlp.yaml")], cwd=work.path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "ok", p.stdout
