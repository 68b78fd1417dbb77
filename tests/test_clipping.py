"""The Triton clip (train/controls/clipping.py) against torch's clip_grad_norm_, and fused SGD against SGD.

On CUDA the clip's norm is a Triton kernel; here (no GPU) the same wrapper runs its
arithmetic as torch ops (`clipping.TorchKernels`), which checks trajectories, the logged
largest norm, plain and fused SGD after it, and a parameter that gets no gradient in
some steps. The kernel's own code runs in Triton's CPU interpreter against that
reference, and on CUDA against torch's clip in the `_cuda` tests (skipped without a
GPU; run on the H100) and, until 2026-11-28, in benchmarks/step_kernels_gpu.py (git history).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpsrun.train.controls import clipping

from mpsrun.train.controls import schedulers
from mpsrun.train.loop.objective import Objective

CPU = torch.device("cpu")
SGD_RULES = [  # the update rules the folded clip + SGD kernel covers
    {},  # momentum 0.9, weight decay 1e-3
    {"nesterov": True},
    {"maximize": True, "weight_decay": 0.0},
    {"momentum": 0.0},
]


class Gated(nn.Module):
    """A second head used on odd steps only: its parameters have no gradient on the others."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 24), nn.ReLU())
        self.a, self.b = nn.Linear(24, 4), nn.Linear(24, 4)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.a(h) if self.step % 2 == 0 else self.a(h) + self.b(h)


def train(
    hooked: bool, fused: bool, max_norm: float = 0.3, momentum: float = 0.9, device: torch.device = CPU, kernels: object = "torch",
    fold: bool = False, tensor_rate: bool = False, **sgd: object,
) -> tuple[torch.Tensor, list[float], str]:
    torch.manual_seed(0)
    model = Gated().to(device)
    kw: dict = {"weight_decay": 1e-3, **sgd}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum, fused=fused, **kw)
    if fused:  # as runner.build_optimizer leaves it on CUDA: a head that joins late gets a zero momentum buffer
        opt.register_step_pre_hook(schedulers.late_momentum_buffers)
    if tensor_rate:  # as controls.py does under graphs with a schedule: a device-tensor rate, then the clip
        opt.param_groups[0]["lr"] = torch.tensor(0.05, device=device)
    obj = Objective.default(device)
    obj.max_norm, obj.grad_norm = max_norm, torch.zeros((), device=device)
    k = clipping.TorchKernels() if kernels == "torch" else None
    note = obj.attach(model, device, False, 1, kernels=k, optimizer=opt if fold else None) if hooked else ""
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3) if tensor_rate else None
    g = torch.Generator().manual_seed(1)
    peaks = []
    for _epoch in range(3):
        for step in range(8):
            model.step = step
            x, y = torch.randn(16, 12, generator=g).to(device), torch.randint(0, 4, (16,), generator=g).to(device)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            obj.clip(model)
            opt.step()
        peaks.append(obj.epoch_metrics()["grad_norm"])
        if sched is not None:
            sched.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), peaks, note


@pytest.mark.parametrize("fused", [False, True], ids=["foreach-multiply", "fused-grad-scale"])
def test_two_stage_clip_follows_torchs_clip(fused: bool) -> None:
    ref, ref_peaks, _ = train(hooked=False, fused=False)
    got, peaks, note = train(hooked=True, fused=fused)
    assert "one Triton kernel" in note
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    assert peaks == pytest.approx(ref_peaks, rel=1e-5)
    assert min(ref_peaks) > 0.3  # the clip really acted: every epoch had a norm above max_norm


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("rule", SGD_RULES, ids=["momentum", "nesterov", "maximize", "plain"])
def test_triton_clip_folded_into_sgd_follows_torchs_clip_then_sgd_cuda(rule: dict) -> None:
    cuda = torch.device("cuda")
    ref, ref_peaks, _ = train(hooked=False, fused=False, device=cuda, **rule)
    got, peaks, note = train(hooked=True, fused=False, device=cuda, kernels=None, fold=True, **rule)
    assert "SGD update in one Triton kernel" in note
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    assert peaks == pytest.approx(ref_peaks, rel=1e-5)
    got2, _, _ = train(hooked=True, fused=False, device=cuda, kernels=None, fold=True, tensor_rate=True, **rule)
    ref2, _, _ = train(hooked=False, fused=False, device=cuda, tensor_rate=True, **rule)
    assert torch.allclose(got2, ref2, atol=1e-5), (got2 - ref2).abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("fused", [False, True], ids=["foreach-multiply", "fused-grad-scale"])
def test_triton_clip_follows_torchs_clip_cuda(fused: bool) -> None:
    cuda = torch.device("cuda")
    ref, ref_peaks, _ = train(hooked=False, fused=False, device=cuda)
    got, peaks, note = train(hooked=True, fused=fused, device=cuda, kernels=None)
    assert "one Triton kernel" in note
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    assert peaks == pytest.approx(ref_peaks, rel=1e-5)


@pytest.mark.parametrize("rule", SGD_RULES, ids=["momentum", "nesterov", "maximize", "plain"])
def test_clip_folded_into_sgd_follows_torchs_clip_then_sgd(rule: dict) -> None:
    """ClipSGD (clip_sgd.py) with the kernel's arithmetic in torch ops: torch's clip, then torch's SGD."""
    ref, ref_peaks, _ = train(hooked=False, fused=False, **rule)
    got, peaks, note = train(hooked=True, fused=False, fold=True, **rule)
    assert "SGD update in one Triton kernel" in note
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    assert peaks == pytest.approx(ref_peaks, rel=1e-5)
    assert min(ref_peaks) > 0.3


def test_clip_folded_into_sgd_reads_a_scheduled_tensor_rate() -> None:
    """Under graphs with a schedule the rate is a device tensor the scheduler fills; the folded step reads it."""
    ref, _, _ = train(hooked=False, fused=False, tensor_rate=True)
    got, _, note = train(hooked=True, fused=False, fold=True, tensor_rate=True)
    assert "SGD update in one Triton kernel" in note
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    plain, _, _ = train(hooked=False, fused=False)
    assert not torch.allclose(plain, ref, atol=1e-3)  # the schedule changed the trajectory


def test_clip_does_not_fold_where_it_would_not_be_sgd_exactly() -> None:
    from mpsrun.train.controls import clip_sgd

    def why(opt_of: object, model: nn.Module | None = None) -> str:
        model = model or Gated()
        obj = Objective.default(CPU)
        obj.max_norm, obj.grad_norm = 1.0, torch.zeros(())
        opt = opt_of(model)  # type: ignore[operator]
        note = obj.attach(model, CPU, False, 1, kernels=clipping.TorchKernels(), optimizer=opt)
        assert "not folded" in note and type(opt) is not clip_sgd.ClipSGD and obj.clipper is not None and not obj.clipper.folded
        return note

    assert "Adam" in why(lambda m: torch.optim.Adam(m.parameters()))
    assert "dampening" in why(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.1))
    assert "group" in why(lambda m: torch.optim.SGD([{"params": m.body.parameters()}, {"params": [*m.a.parameters(), *m.b.parameters()]}], lr=0.1))
    assert "exactly" in why(lambda m: torch.optim.SGD(m.body.parameters(), lr=0.1))

    frozen = Gated()
    frozen.b.requires_grad_(False)  # a frozen head the optimizer holds but never steps: still folds
    obj = Objective.default(CPU)
    obj.max_norm, obj.grad_norm = 1.0, torch.zeros(())
    opt = torch.optim.SGD(frozen.parameters(), lr=0.1)
    assert "SGD update in one Triton kernel" in obj.attach(frozen, CPU, False, 1, kernels=clipping.TorchKernels(), optimizer=opt)
    assert type(opt) is clip_sgd.ClipSGD
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPSRUN_CLIP_FOLD", "0")
        assert "MPSRUN_CLIP_FOLD=0" in why(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    deep = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])  # 10 tensors: more than one launch's 8 slots
    assert "10 parameter tensors" in why(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), deep)


def test_two_kernel_clip_is_not_used_where_it_would_be_wrong() -> None:
    model = nn.Linear(3, 2)
    cuda = torch.device("cuda")
    for args, why in (((cuda, 2.0, True, 1), "fp16"), ((cuda, 2.0, False, 2), "DDP"), ((cuda, 1.0, False, 1), "2-norm"), ((CPU, 2.0, False, 1), "off CUDA")):
        assert why in (clipping.usable(model, *args) or "")
    obj = Objective.default(CPU)
    obj.max_norm, obj.grad_norm = 1.0, torch.zeros(())
    assert "clip_grad_norm_" in obj.attach(model, CPU, False, 1) and obj.clipper is None


def test_sgd_is_built_fused_only_on_cuda_under_graphs_with_a_schedule() -> None:
    params = list(nn.Linear(3, 2).parameters())
    cuda, sgd = torch.device("cuda"), torch.optim.SGD
    assert schedulers.fused_sgd(sgd, {"lr": 0.1, "momentum": 0.9}, params, cuda, graphs=True, scheduled=True)
    assert not schedulers.fused_sgd(sgd, {"lr": 0.1}, params, CPU, graphs=True, scheduled=True)  # off CUDA
    assert not schedulers.fused_sgd(sgd, {"lr": 0.1}, params, cuda, graphs=False, scheduled=True)  # eager reads a float
    assert not schedulers.fused_sgd(sgd, {"lr": 0.1}, params, cuda, graphs=True, scheduled=False)  # no tensor rate needed
    assert not schedulers.fused_sgd(sgd, {"lr": 0.1, "foreach": True}, params, cuda, graphs=True, scheduled=True)  # the user's choice
    assert not schedulers.fused_sgd(sgd, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}, params, cuda, graphs=True, scheduled=True)
    assert not schedulers.fused_sgd(torch.optim.Adam, {}, params, cuda, graphs=True, scheduled=True)
    assert not schedulers.fused_sgd(sgd, {"lr": 0.1}, [p.half() for p in params], cuda, graphs=True, scheduled=True)
    opt = torch.optim.SGD(params, lr=0.1)  # plain SGD (what a CPU run builds) gets TensorLRSGD's foreach kernels
    assert "foreach" in schedulers.tensor_lr(opt, CPU) and type(opt) is schedulers.TensorLRSGD
    fused = torch.optim.SGD(params, lr=0.1, fused=True)
    assert "fused" in schedulers.tensor_lr(fused, CPU) and type(fused) is torch.optim.SGD


def test_fused_sgd_with_a_tensor_rate_follows_a_schedule_like_plain_sgd() -> None:
    """What `tensor_lr` switches CUDA's SGD to (fused, rate a tensor the scheduler fills), run here."""

    def run(fused: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Linear(6, 3)
        lr: float | torch.Tensor = torch.tensor(0.1) if fused else 0.1
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5, fused=fused)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
        g = torch.Generator().manual_seed(2)
        for _ in range(4):
            for _ in range(5):
                x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            sched.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.allclose(run(True), run(False), atol=1e-6)


def test_triton_kernels_match_the_torch_reference_in_tritons_interpreter() -> None:
    """The Triton kernels' own code, run by Triton's CPU interpreter (TRITON_INTERPRET=1) in a child process."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="Triton is not installed here (it ships with torch's Linux wheels)")
    if torch.cuda.is_available():  # older Tritons' interpreters lack a scalar `if` on an atomic's result
        pytest.skip("on a CUDA machine the _cuda tests run the kernel itself")
    code = """
import torch
from mpsrun.train.controls import clipping
g = torch.Generator().manual_seed(0)
shapes = [(512, 784), (512,), (512, 512), (512,), (10, 512), (10,), (3, 3), (7,), (100,), (1,)]
grads = [torch.randn(s, generator=g) for s in shapes]  # 10 gradients: two launches of 8 slots
out = []
for k in (clipping.TritonKernels(), clipping.TorchKernels()):
    partials, counter = torch.zeros(2 * clipping.PROGRAMS), torch.zeros((), dtype=torch.int32)
    for max_norm in (5.0, 1e4, 5.0):  # clipping, then not (scale 1), then again: the counter resets
        peak, inv = torch.full((), 900.0 if max_norm > 100 else 0.0), torch.ones(())
        k.clip_norm(grads, partials, counter, peak, inv, max_norm)
        out.append((peak.item(), inv.item(), counter.item()))
print(out)
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = eval(r.stdout.strip().splitlines()[-1])
    tri, ref = got[:3], got[3:]
    for t, f in zip(tri, ref):
        assert t[:2] == pytest.approx(f[:2], rel=1e-5)
    assert tri[0][1] < 1.0 and tri[0] == tri[2]  # clipped, and the same again once the counter is reset
    assert tri[1][:2] == (900.0, 1.0)  # a higher running max kept; no clip
    assert all(t[2] == 0 for t in tri)  # the counter is back to 0 after each step
    norm = torch.linalg.vector_norm(torch.cat([torch.randn(s, generator=torch.Generator().manual_seed(0)).flatten() for s in [(512, 784)]]))
    assert tri[0][0] > norm.item()  # the norm covers every gradient, not only the first


def test_clip_sgd_kernel_matches_the_torch_reference_in_tritons_interpreter() -> None:
    """clip_kernels.clip_sgd's own code in Triton's CPU interpreter, against TorchKernels.clip_sgd.

    The interpreter runs programs one after another, so the one-launch mode (a grid-wide
    wait) runs with one program; the two-launch mode runs the same code with four, each
    walking blocks of several tensors round-robin. The grid-wide wait itself runs on CUDA
    (the `_cuda` tests).
    """
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="Triton is not installed here (it ships with torch's Linux wheels)")
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the _cuda tests run the kernel itself")
    code = """
import torch
from mpsrun.train.controls import clipping
shapes = [(40, 30), (40,), (25, 40), (25,), (3, 25), (3,)]
out = []
for mode, programs in ((0, 1), (1, 4)):
    for rule in ({"momentum": 0.9, "nesterov": False, "maximize": False, "weight_decay": 1e-2, "lr": 0.1},
                 {"momentum": 0.5, "nesterov": True, "maximize": True, "weight_decay": 0.0, "lr": torch.tensor(0.2)},
                 {"momentum": 0.0, "nesterov": False, "maximize": False, "weight_decay": 0.0, "lr": 0.3}):
        res = []
        for k in (clipping.TritonKernels(), clipping.TorchKernels()):
            g = torch.Generator().manual_seed(0)
            params = [torch.randn(s, generator=g) for s in shapes]
            bufs = [torch.zeros_like(p) for p in params] if rule["momentum"] else None
            state = clipping.SGDState(2.0, torch.zeros(()), programs)
            peaks = []
            for step in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g) * (0.01 if step == 1 else 1.0)  # step 1: no clip
                k.clip_sgd(state, params, bufs, rule, mode=mode, block=256)
                peaks.append((state.peak.item(), state.inv.item(), state.counters.tolist()))
            res.append((torch.cat([p.flatten() for p in params]), peaks))
        (tp, tk), (rp, rk) = res
        out.append(((tp - rp).abs().max().item(), [a[:2] for a in tk], [a[:2] for a in rk], [a[2] for a in tk]))
print(out)
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = eval(r.stdout.strip().splitlines()[-1])
    assert len(got) == 6
    for diff, tri, ref, counters in got:
        assert diff < 1e-5
        for t, f in zip(tri, ref):
            assert t == pytest.approx(f, rel=1e-5)
        assert tri[0][1] < 1.0 and tri[1][1] == 1.0  # clipped, then not (small gradients)
        assert all(c == [0, 0] for c in counters)  # ready for the next step after each
