"""The Triton clip (train/clipping.py) against torch's clip_grad_norm_, and fused SGD against SGD.

On CUDA the clip's norm is a Triton kernel; here (no GPU) the same wrapper runs its
arithmetic as torch ops (`clipping.TorchKernels`), which checks trajectories, the logged
largest norm, plain and fused SGD after it, and a parameter that gets no gradient in
some steps. The kernel's own code runs in Triton's CPU interpreter against that
reference, and on CUDA against torch's clip in the `_cuda` tests (skipped without a
GPU; run on the H100) and in benchmarks/step_kernels_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpsrun.train import clipping, schedulers
from mpsrun.train.objective import Objective

CPU = torch.device("cpu")


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


def train(hooked: bool, fused: bool, max_norm: float = 0.3, momentum: float = 0.9, device: torch.device = CPU, kernels: object = "torch") -> tuple[torch.Tensor, list[float], str]:
    torch.manual_seed(0)
    model = Gated().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum, weight_decay=1e-3, fused=fused)
    if fused:  # as fuse_sgd leaves it on CUDA: a head that joins late gets a zero momentum buffer
        opt.register_step_pre_hook(schedulers._late_momentum_buffers)
    obj = Objective.default(device)
    obj.max_norm, obj.grad_norm = max_norm, torch.zeros((), device=device)
    note = obj.attach(model, device, False, 1, kernels=clipping.TorchKernels() if kernels == "torch" else None) if hooked else ""
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
@pytest.mark.parametrize("fused", [False, True], ids=["foreach-multiply", "fused-grad-scale"])
def test_triton_clip_follows_torchs_clip_cuda(fused: bool) -> None:
    cuda = torch.device("cuda")
    ref, ref_peaks, _ = train(hooked=False, fused=False, device=cuda)
    got, peaks, note = train(hooked=True, fused=fused, device=cuda, kernels=None)
    assert "one Triton kernel" in note
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    assert peaks == pytest.approx(ref_peaks, rel=1e-5)


def test_two_kernel_clip_is_not_used_where_it_would_be_wrong() -> None:
    model = nn.Linear(3, 2)
    cuda = torch.device("cuda")
    for args, why in (((cuda, 2.0, True, 1), "fp16"), ((cuda, 2.0, False, 2), "DDP"), ((cuda, 1.0, False, 1), "2-norm"), ((CPU, 2.0, False, 1), "off CUDA")):
        assert why in (clipping.usable(model, *args) or "")
    obj = Objective.default(CPU)
    obj.max_norm, obj.grad_norm = 1.0, torch.zeros(())
    assert "clip_grad_norm_" in obj.attach(model, CPU, False, 1) and obj.clipper is None


def test_fuse_sgd_only_on_cuda_and_keeps_sgd_alone_elsewhere() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert schedulers.fuse_sgd(opt, CPU) is False
    assert not opt.param_groups[0].get("fused")
    assert "foreach" in schedulers.tensor_lr(opt, CPU) and type(opt) is schedulers.TensorLRSGD


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
from mpsrun.train import clipping
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
