"""SGD's update for stacked members as one Triton kernel (sweep/fused/kernels/tsgd.py) against the fused
optimizer's torch ops, in Triton's CPU interpreter (a child process); on CUDA the fused-group tests
(test_sweep_fused.py, test_fused_graphs.py) train with it."""

from __future__ import annotations

from tests.proc_helpers import in_triton_interpreter

CODE = """
import json, torch
from mpsrun.sweep.fused.optim import FusedOptimizer, Hyper
from mpsrun.sweep.fused.kernels import tsgd
BROKEN = %r  # a kernel whose update is 1%% off: the comparison below and the check must both see it
if BROKEN:
    _step = tsgd.step
    tsgd.step = lambda opt, p, g, buf: _step(opt, p, g * 1.01, buf)
out = []
gen = torch.Generator().manual_seed(0)
# (members' hyperparameters, steps): momentum mixed with none, dampening (its first step), nesterov, weight decay
CASES = [([Hyper(0.1, 1e-2, 0.9), Hyper(0.05, 0.0, 0.0), Hyper(0.2, 1e-3, 0.5)], 3),
         ([Hyper(0.1, 0.0, 0.9, 0.3), Hyper(0.01, 1e-2, 0.8, 0.1)], 3),
         ([Hyper(0.1, 0.0, 0.9, 0.0, True), Hyper(0.3, 1e-2, 0.7)], 2),
         ([Hyper(0.1), Hyper(0.2, 1e-2)], 2)]
for hypers, steps in CASES:
    m = len(hypers)
    shape = (m, 37, 5)  # 37 * 5 values a member: a member's block ends inside a kernel block
    p0 = torch.randn(shape, generator=gen)
    mine, ref = FusedOptimizer("sgd", [p0.clone()], hypers, exact=False), FusedOptimizer("sgd", [p0.clone()], hypers, exact=False)
    buf = torch.zeros(shape) if mine.any_mom else None
    for s in range(steps):
        g = torch.randn(shape, generator=gen)
        for o in (mine, ref):
            o.step_t.add_(1)
        tsgd.step(mine, mine.params[0], g.clone(), buf)
        ref._sgd_one(ref.params[0], g.clone(), ref.state[0])
    err = float((mine.params[0] - ref.params[0]).abs().max() / ref.params[0].abs().max())
    berr = float((buf - ref.state[0]["buf"]).abs().max() / ref.state[0]["buf"].abs().max()) if buf is not None else 0.0
    try:
        tsgd.check(mine, p0, torch.float32, buf is not None, mine.reference)
        checked = "ok"
    except tsgd.Mismatch as e:
        checked = str(e)
    out.append([err, berr, checked])
print(json.dumps(out))
"""


def test_the_sgd_kernel_gives_the_fused_optimizer_s_update_in_triton_s_interpreter() -> None:
    for err, berr, checked in in_triton_interpreter(CODE % False):
        assert err <= 1e-6 and berr <= 1e-6 and checked == "ok"


def test_a_wrong_sgd_kernel_is_caught_by_its_check() -> None:
    """The check compares against the torch ops: a kernel whose update is off must not pass it."""
    results = in_triton_interpreter(CODE % True)
    assert all(err > 1e-4 for err, _, _ in results)
    assert all(checked.startswith("SGD ") for _, _, checked in results)


def test_which_groups_take_the_sgd_kernel_and_what_their_note_says(monkeypatch) -> None:  # noqa: ANN001
    import pytest
    import torch

    from mpsrun.sweep.fused import graphed
    from mpsrun.sweep.fused.optim import FusedOptimizer, Hyper

    pytest.importorskip("triton", reason="Triton is not installed here")
    cuda = torch.device("cuda")  # a device object only: nothing runs on it

    def group(kind: str, exact: bool = False, device: torch.device = cuda) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(opt=FusedOptimizer(kind, [torch.zeros(2, 3)], [Hyper(0.1), Hyper(0.2)], exact), device=device)

    b = group("sgd")
    assert graphed._sgd_kernel(b, print) == "; optimizer: SGD's update as one Triton kernel a parameter (checked against torch's ops)"
    assert b.opt.kernel is not None
    for other in (group("adam"), group("sgd", exact=True), group("sgd", device=torch.device("cpu"))):
        assert graphed._sgd_kernel(other, print) == "" and other.opt.kernel is None
    monkeypatch.setenv("MPSRUN_FUSED_OPTIM", "0")
    off = group("sgd")
    assert graphed._sgd_kernel(off, print) == "; optimizer: SGD's update as torch's ops (MPSRUN_FUSED_OPTIM=0)" and off.opt.kernel is None
