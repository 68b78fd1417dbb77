"""The channels_last max-pool kernels (train/kernels/fused_pool.py): their answers, and when a run uses them.

The kernels run here in Triton's CPU interpreter (TRITON_INTERPRET=1, a child process, with
`fits` widened to CPU tensors); on a CUDA machine the `_cuda` test trains a small CNN with them
inside CUDA graphs against the same run with torch's max-pool.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from mpsrun.train.assemble import _fuse_pools
from mpsrun.train.kernels import fused_pool
from mpsrun.train.loop.steps import Options
from tests.proc_helpers import in_triton_interpreter

CHECK = """
import json, torch
from torch import nn
from mpsrun.train.kernels import fused_pool as fp
fp.fits = lambda x: x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)  # the interpreter runs on CPU tensors
out = []
# ResNet's stem (3x3, stride 2, padding 1) on odd and even sizes, a 2x2 pool, overlapping stride-1 windows, bf16 with 64 channels
for shape, geo, dtype in [((2, 5, 9, 7), (3, 3, 2, 1), torch.float32), ((3, 4, 8, 8), (2, 2, 2, 0), torch.float32),
                          ((2, 3, 7, 6), (3, 3, 1, 1), torch.float32), ((2, 64, 12, 12), (3, 3, 2, 1), torch.bfloat16)]:
    fp.check(shape, dtype, torch.device("cpu"), geo)  # raises Mismatch unless output and input gradient are torch's, NaNs and ties included
    out.append(["checked", list(shape), list(geo), str(dtype)])
# swapped into a model: the same output and gradients as the plain model, and the module's own forward back afterwards
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Conv2d(8, 4, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 2))
net = net.to(memory_format=torch.channels_last)
x = torch.randn(4, 3, 13, 13).contiguous(memory_format=torch.channels_last)
ref = net(x)
ref.square().sum().backward()
ref_grads = [p.grad.clone() for p in net.parameters()]
net.zero_grad()
pools = fp.plan(net)
calls = []
real = fp.max_pool
fp.max_pool = lambda *a, **k: calls.append(1) or real(*a, **k)
with pools.swapped():
    got = net(x)
    got.square().sum().backward()
out.append(["swap", len(pools.modules), len(calls), torch.equal(got, ref), all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), ref_grads)),
            any("forward" in m.__dict__ for m, _ in pools.modules)])
print(json.dumps(out))
"""


def test_the_kernels_give_torch_s_answers_in_triton_s_interpreter() -> None:
    out = in_triton_interpreter(CHECK)
    assert [r[0] for r in out] == ["checked"] * 4 + ["swap"]
    _, modules, calls, same_out, same_grads, left_behind = out[-1]
    assert modules == 2 and calls == 2  # both pools ran through the kernels
    assert same_out and same_grads  # bit-equal to torch's max-pool, forward and backward
    assert not left_behind  # the modules' own forward is theirs again after the block


def test_check_raises_on_a_kernel_that_breaks_ties_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check` is what stands between a wrong kernel and a run: it must see a different winner."""
    monkeypatch.setattr(fused_pool, "_forward", lambda x, geo, want_idx: (nn.functional.max_pool2d(x, geo[:2], geo[2], geo[3]),
                                                                          torch.zeros(1, dtype=torch.int8)))
    monkeypatch.setattr(fused_pool, "_backward", lambda g, idx, shape, geo: torch.zeros(shape, dtype=g.dtype))  # gradients lost
    with pytest.raises(fused_pool.Mismatch, match="input gradient"):
        fused_pool.check((2, 3, 9, 9), torch.float32, torch.device("cpu"), (3, 3, 2, 1))


def test_a_cuda_run_takes_them_where_they_apply_and_says_why_not_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton", reason="Triton is not installed here")
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(3, 2, 1), nn.Flatten())
    on = Options(graphs=True, channels_last=True)
    assert _fuse_pools(cnn, cuda, on, ) == "" and on.fused_pool and on.as_params()["resolved.fused_pool"] == "true"
    for options, why in ((Options(graphs=False, channels_last=True), "graphs are off"), (Options(graphs=True), "channels_last is off")):
        assert why in _fuse_pools(cnn, cuda, options) and not options.fused_pool
    monkeypatch.setenv("MPSRUN_FUSED_POOL", "0")
    off = Options(graphs=True, channels_last=True)
    assert _fuse_pools(cnn, cuda, off) == "pools: torch's max-pool kernels, not the fused ones (MPSRUN_FUSED_POOL=0)"
    monkeypatch.delenv("MPSRUN_FUSED_POOL")
    # nothing to say where nothing was expected: the CPU, a model without max-pools, pools the kernels are not for
    assert _fuse_pools(cnn, torch.device("cpu"), Options(graphs=True, channels_last=True)) == ""
    for model in (nn.Sequential(nn.Conv2d(3, 4, 3)), nn.Sequential(nn.MaxPool2d(3, 2, 1, dilation=2)), nn.Sequential(nn.MaxPool2d(3, 2, ceil_mode=True))):
        options = Options(graphs=True, channels_last=True)
        assert _fuse_pools(model, cuda, options) == "" and not options.fused_pool
    hooked = nn.Sequential(nn.MaxPool2d(2))
    hooked[0].register_forward_hook(lambda *a: None)
    assert fused_pool.plan(hooked) is None  # a hook would be skipped by the swapped forward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the kernels compiled for a GPU)")
def test_graphs_with_the_kernels_train_as_torch_s_max_pool_cuda() -> None:
    """A small CNN trained 3 replays of 2-step graphs (bf16, channels_last) with the kernels and with torch's max-pool:
    the same parameters to the bit where cuDNN is deterministic, and the modules plain afterwards."""
    from mpsrun.train.loop.data import BatchPlan, ResidentBatches
    from mpsrun.train.loop.events import Listener
    from mpsrun.train.loop.steps import GraphTrainer

    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, 32, generator=gen).to(dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (64,), generator=gen).to(dev)
    results = []
    for pools in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                              nn.Conv2d(16, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).to(dev)
        model = model.to(memory_format=torch.channels_last)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)  # as the engine builds it under graphs
        options = Options(precision="bf16", channels_last=True, graphs=True, fused_pool=pools)
        trainer = GraphTrainer(model, opt, dev, options)
        assert (trainer.pools is not None) == pools
        batches = ResidentBatches(x, y, 16, dev, True, 0)
        plan = BatchPlan(batches, ResidentBatches(x[:32], y[:32], 16, dev, False, 0), True, "test")
        trainer.capture(plan)
        for epoch in range(3):
            trainer.train_epoch(plan, epoch, Listener())
        torch.cuda.synchronize()
        assert not any("forward" in m.__dict__ for m in model.modules())
        results.append([p.detach().float().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_capture_that_fails_with_the_kernels_is_retried_without_them_and_said_capture_simulated() -> None:
    """The fallback order of engine._capture_or_eager: the max-pool kernels go first (then the fused layers, then the
    graphs), each said. CUDA graph capture cannot run here, so `capture` is a stand-in that fails once."""
    from mpsrun.train.loop import engine
    from mpsrun.train.loop.events import Listener

    class Notes(Listener):
        def __init__(self) -> None:
            self.notes: list[str] = []

        def on_note(self, message: str, warn: bool = True) -> None:
            self.notes.append(message)

    class Stand:  # what _capture_or_eager reads of a GraphTrainer
        def __init__(self) -> None:
            self.options = Options(graphs=True, channels_last=True, fused_pool=True, fused_linear=True)
            self.graphs, self.pool, self.pools, self.fused, self.calls = {"k": 1}, object(), object(), object(), 0

        def capture(self, plan: object) -> None:
            self.calls += 1
            if self.calls == 1:
                raise fused_pool.Mismatch("max-pool (2, 3, 9, 9) torch.bfloat16: the output differs from torch's")

    stand, listener = Stand(), Notes()
    assert engine._capture_or_eager(stand, None, listener) is stand  # type: ignore[arg-type]
    assert stand.calls == 2 and not stand.options.fused_pool and stand.pools is None and not stand.graphs
    assert stand.options.fused_linear and stand.options.graphs  # only the kernels that failed were given up
    assert listener.notes == stand.options.notes[-1:]
    assert listener.notes[0].startswith("pools: torch's max-pool kernels, not the fused ones (Mismatch before or during capture: max-pool")
