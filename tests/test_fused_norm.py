"""The batch-norm statistics kernel (train/kernels/fused_norm.py; opt-in): its arithmetic, and when a run uses it.

The kernels run here in Triton's CPU interpreter (TRITON_INTERPRET=1, a child process); torch's
`batch_norm_stats` and the ops around it exist on CUDA only, so there the reference is float64
arithmetic, and on a CUDA machine the `_cuda` test trains a small CNN with the kernel inside CUDA
graphs against torch's batch-norm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from mpsrun.train.assemble import _fuse_norms
from mpsrun.train.kernels import fused_norm
from mpsrun.train.loop.steps import Options

CHECK = """
import json, torch
from mpsrun.train.kernels import fused_norm as fn
def ref(x, eps):  # torch.batch_norm_stats' answer, in float64
    v = x.double().permute(0, 2, 3, 1).reshape(-1, x.shape[1])
    return v.mean(0).float(), (1 / (v.var(0, unbiased=False) + eps).sqrt()).float()
out = []
# rows over many programs and a ragged last block, channels over two blocks and ragged, bf16, one row per channel block
for shape, dtype in [((8, 64, 20, 20), torch.float32), ((3, 100, 7, 5), torch.float32), ((4, 64, 9, 9), torch.bfloat16), ((1, 70, 1, 2), torch.float32)]:
    fn.check(shape, dtype, torch.device("cpu"), 1e-5, reference=ref)  # an offset of 50 against a spread of 3: Mismatch beyond 1e-4
    out.append(["checked", list(shape)])
fn.PROGRAMS = 4  # few programs: each reduces many row blocks and combines them as it goes
fn.check((4, 8, 30, 30), torch.float32, torch.device("cpu"), 1e-5, reference=ref)
out.append(["long"])
print(json.dumps(out))
"""


def test_the_statistics_are_float64_s_in_triton_s_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed here")
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the _cuda test runs the kernels themselves")
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r[0] for r in json.loads(done.stdout.strip().splitlines()[-1])] == ["checked"] * 4 + ["long"]


def test_check_raises_on_statistics_off_by_more_than_the_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    def ref(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        v = x.double().permute(0, 2, 3, 1).reshape(-1, x.shape[1])
        return v.mean(0).float(), (1 / (v.var(0, unbiased=False) + eps).sqrt()).float()

    monkeypatch.setattr(fused_norm, "stats", lambda x, eps: (lambda m, i: (m, i * (1 + 1e-3)))(*ref(x, eps)))  # invstd 0.1% off
    with pytest.raises(fused_norm.Mismatch, match="invstd"):
        fused_norm.check((2, 4, 5, 5), torch.float32, torch.device("cpu"), 1e-5, reference=ref)


def test_it_is_opt_in_and_says_why_not_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    off = Options(graphs=True, channels_last=True)
    assert _fuse_norms(cnn, cuda, off) == "" and not off.fused_norm  # not asked: nothing to say
    monkeypatch.setenv("MPSRUN_FUSED_NORM", "1")
    on = Options(graphs=True, channels_last=True)
    assert _fuse_norms(cnn, cuda, on) == "" and on.fused_norm and on.as_params()["resolved.fused_norm"] == "true"
    assert "graphs are off" in _fuse_norms(cnn, cuda, Options(graphs=False, channels_last=True))
    assert "channels_last is off" in _fuse_norms(cnn, cuda, Options(graphs=True))
    assert _fuse_norms(cnn, torch.device("cpu"), Options(graphs=True, channels_last=True)) == ""
    cumulative = nn.Sequential(nn.BatchNorm2d(4, momentum=None))  # its average reads a count on the host
    assert fused_norm.plan(cumulative) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's batch-norm ops and the kernels on a GPU)")
def test_graphs_with_the_statistics_train_as_torch_s_batch_norm_cuda() -> None:
    """A small CNN, 3 epochs of graph replays (fp32, channels_last, SGD), with the kernel and with torch's batch-norm:
    parameters and running statistics within fp32 rounding of each other, and the modules plain afterwards. (bf16
    and Adam, as the zoo trains, amplify rounding: the last bit of a bf16 output, or the sign of a near-zero
    gradient under Adam, moves a parameter by a whole step; `check` and the zoo run cover them.)"""
    from mpsrun.train.loop.data import BatchPlan, ResidentBatches
    from mpsrun.train.loop.events import Listener
    from mpsrun.train.loop.steps import GraphTrainer

    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, 32, generator=gen).to(dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (64,), generator=gen).to(dev)
    results = []
    for norms in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3), nn.BatchNorm2d(8),
                              nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).to(dev).to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        trainer = GraphTrainer(model, opt, dev, Options(precision="fp32", channels_last=True, graphs=True, fused_norm=norms))
        assert (trainer.norms is not None) == norms
        plan = BatchPlan(ResidentBatches(x, y, 16, dev, True, 0), ResidentBatches(x[:32], y[:32], 16, dev, False, 0), True, "test")
        trainer.capture(plan)
        for epoch in range(3):
            trainer.train_epoch(plan, epoch, Listener())
        torch.cuda.synchronize()
        assert not any("forward" in m.__dict__ for m in model.modules())
        results.append([t.detach().float().clone() for t in (*model.parameters(), *model.buffers())])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
