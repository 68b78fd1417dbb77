"""The hooked clip (train/clipping.py) against torch's clip_grad_norm_, and fused SGD against SGD.

On CUDA the hooked clip takes norms on a side stream; here (no GPU) it runs the same
hooks in line (`in_line=True`), which checks its arithmetic: trajectories, the logged
largest norm, the fused optimizer's `grad_scale` path and the foreach one, norm types,
and a parameter that gets no gradient in some steps. The stream ordering itself runs
on the GPU machine (benchmarks/step_kernels_gpu.py compares its parameters with torch's).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpsrun.train import schedulers
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


def train(hooked: bool, fused: bool, norm_type: float = 2.0, max_norm: float = 0.3, momentum: float = 0.9) -> tuple[torch.Tensor, list[float], str]:
    torch.manual_seed(0)
    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum, weight_decay=1e-3, fused=fused)
    if fused:  # as fuse_sgd leaves it on CUDA: a head that joins late gets a zero momentum buffer
        opt.register_step_pre_hook(schedulers._late_momentum_buffers)
    obj = Objective.default(CPU)
    obj.max_norm, obj.norm_type, obj.grad_norm = max_norm, norm_type, torch.zeros(())
    note = obj.attach(model, opt, CPU, False, 1, in_line=True) if hooked else ""
    g = torch.Generator().manual_seed(1)
    peaks = []
    for _epoch in range(3):
        for step in range(8):
            model.step = step
            x, y = torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            obj.clip(model)
            opt.step()
            obj.end_step()
        peaks.append(obj.epoch_metrics()["grad_norm"])
    return torch.cat([p.detach().flatten() for p in model.parameters()]), peaks, note


@pytest.mark.parametrize("fused", [False, True], ids=["foreach-multiply", "fused-grad-scale"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_hooked_clip_follows_torchs_clip(fused: bool, norm_type: float) -> None:
    ref, ref_peaks, _ = train(hooked=False, fused=False, norm_type=norm_type)
    got, peaks, note = train(hooked=True, fused=fused, norm_type=norm_type)
    assert ("fused optimizer" in note) == fused and "during backward" in note
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    assert peaks == pytest.approx(ref_peaks, rel=1e-5)
    assert min(ref_peaks) > 0.3  # the clip really acted: every epoch had a norm above max_norm


def test_hooked_clip_is_not_used_where_it_would_be_wrong() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for fp16, world, why in ((True, 1, "fp16"), (False, 2, "DDP")):
        obj = Objective.default(CPU)
        obj.max_norm, obj.grad_norm = 1.0, torch.zeros(())
        assert why in obj.attach(model, opt, CPU, fp16, world, in_line=True) and obj.clipper is None
    obj = Objective.default(CPU)
    obj.max_norm, obj.grad_norm = 1.0, torch.zeros(())
    assert "clip_grad_norm_" in obj.attach(model, opt, CPU, False, 1) and obj.clipper is None  # CPU by default: torch's clip


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
