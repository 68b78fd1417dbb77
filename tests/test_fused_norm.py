"""The batch-norm kernels (train/kernels/fused_norm.py) and the graph rewrite that folds ReLUs and residual adds into them.

The kernels run here in Triton's CPU interpreter (TRITON_INTERPRET=1, a child process), checked against
torch's batch-norm in fp32 on the CPU; on a CUDA machine the `_cuda` test trains small CNNs with the
kernels inside CUDA graphs against torch's batch-norm.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from mpsrun.train.assemble import _fuse_norms
from mpsrun.train.kernels import fused_norm, norm_graph
from mpsrun.train.loop.steps import Options
from tests.proc_helpers import in_triton_interpreter

CHECK = """
import json, torch, torchvision
from torch import nn
from mpsrun.train.kernels import fused_norm as fn
out = []
# rows over many programs and a ragged last block, channels over two blocks and ragged, bf16, one row per channel block
for shape, dtype in [((8, 64, 20, 20), torch.float32), ((3, 100, 7, 5), torch.float32), ((4, 64, 9, 9), torch.bfloat16), ((1, 70, 1, 2), torch.float32),
                     ((5, 1, 6, 6), torch.float32), ((2, 3, 4, 4), torch.bfloat16)]:
    for act, res in ((fn.NONE, False), (fn.RELU, False), (fn.RELU, True), (fn.RELU6, False), (fn.SILU, False)):
        fn.check(shape, dtype, torch.device("cpu"), 1e-5, act, res)  # an offset of 50 against a spread of 3
    out.append(["checked", list(shape)])
fn.PROGRAMS = 4  # few programs: each reduces many row blocks
fn.check((4, 8, 30, 30), torch.float32, torch.device("cpu"), 1e-5, fn.RELU, True)
out.append(["long"])
# the whole rewrite on whole models: outputs, gradients and running statistics off from float64 by about as much as torch's fp32 (each layer is held to 1e-4 above; a deep net amplifies rounding alike)
import copy
fn.fits = lambda x: x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and x.numel() > x.shape[1]
# Shallow versions of the three (a block or two of each stage kind: Triton's interpreter runs every program in Python,
# so its time is per layer; the full nets took 62 s of a 2-core machine for no kind of layer these do not have).
from torchvision.models import MobileNetV2, ResNet
from torchvision.models.efficientnet import EfficientNet, MBConvConfig
from torchvision.models.resnet import BasicBlock
ARCHS = {"resnet": lambda: ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10),  # a residual block per stage, 3 downsamples
         "mobilenet_v2": lambda: MobileNetV2(num_classes=10, inverted_residual_setting=[[1, 16, 1, 1], [6, 24, 1, 2], [6, 32, 2, 2]]),
         "efficientnet": lambda: EfficientNet([MBConvConfig(1, 3, 1, 32, 16, 1), MBConvConfig(6, 3, 2, 16, 24, 2)], dropout=0.0, num_classes=10)}
for arch, make in ARCHS.items():  # ReLU and residual adds; ReLU6; SiLU (with squeeze-excitation)
    torch.manual_seed(0)
    model = make().to(memory_format=torch.channels_last).train()
    for m in model.modules():
        if isinstance(getattr(m, "p", None), float):
            m.p = 0.0  # dropout and stochastic depth off: the three runs see one function
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    wide = copy.deepcopy(model).double()
    norms = fn.Norms(model)

    def run(m, inp, fused):
        for mm in m.modules():
            if isinstance(mm, nn.BatchNorm2d):
                mm.reset_running_stats()
        m.zero_grad()
        with (norms.swapped() if fused else torch.enable_grad()):
            y = m(inp)
        y.square().sum().backward()
        return [y.detach().double().flatten(), torch.cat([p.grad.double().flatten() for p in m.parameters()]),
                torch.cat([b.double().flatten() for b in m.buffers()])]

    ref, ours, theirs = run(wide, x.double(), False), run(model, x, True), run(model, x, False)
    off = lambda got: [((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref)]
    out.append([arch, off(ours), off(theirs), norms.describe(), "forward" in model.__dict__])
print(json.dumps(out))
"""


def test_the_kernels_are_torch_s_batch_norm_in_triton_s_interpreter() -> None:
    rows = in_triton_interpreter(CHECK, timeout=600)
    assert [r[0] for r in rows] == ["checked"] * 6 + ["long", "resnet", "mobilenet_v2", "efficientnet"]
    described = {}
    for arch, ours, theirs, text, left in rows[-3:]:  # (output, gradients, running statistics) off from float64
        assert all(o <= max(4 * t, 1e-5) for o, t in zip(ours, theirs)) and not left, (arch, ours, theirs)  # rounding amplified by depth alike
        described[arch] = text
    # every batch-norm found, and every ReLU / ReLU6 / SiLU and residual add that follows one folded in: the stem's, each
    # block's (a ResNet block: two, the second after its add; MobileNetV2's expand and depthwise; MBConv's the same), the
    # head's; 3 downsample batch-norms in the ResNet; MobileNetV2's and MBConv's adds have no activation after them
    assert described == {"resnet": "12 batch-norms; activations folded in: 9 ReLU; residual adds folded in: 4",
                         "mobilenet_v2": "13 batch-norms; activations folded in: 9 ReLU6; residual adds folded in: 0",
                         "efficientnet": "10 batch-norms; activations folded in: 7 SiLU; residual adds folded in: 0"}


class _Scaled(torch.autograd.Function):
    """Identity forward; the gradient 1% off (a kernel whose backward is wrong)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        return g * 1.01


@pytest.mark.parametrize("wrong", ["output", "input gradient"])
def test_check_raises_on_a_layer_off_by_more_than_the_tolerance(monkeypatch: pytest.MonkeyPatch, wrong: str) -> None:
    class Wrong:
        @staticmethod
        def apply(x, w, b, res, rm, rv, momentum, eps, act):  # type: ignore[no-untyped-def]
            x = _Scaled.apply(x) if wrong == "input gradient" else x
            y = nn.functional.batch_norm(x, rm, rv, w, b, True, momentum, eps) + (res if res is not None else 0)
            y = fused_norm.activate(y, act)
            return y * 1.01 if wrong == "output" else y

    monkeypatch.setattr(fused_norm, "_NormAct", Wrong)
    with pytest.raises(fused_norm.Mismatch, match=f"the {wrong} is off"):
        fused_norm.check((2, 4, 5, 5), torch.float32, torch.device("cpu"), 1e-5, fused_norm.RELU, True)
    monkeypatch.setattr(fused_norm, "TOLERANCE", {torch.float32: 0.05})  # within a looser tolerance the same layer passes
    fused_norm.check((2, 4, 5, 5), torch.float32, torch.device("cpu"), 1e-5, fused_norm.RELU, True)


class _Block(nn.Module):
    """Batch-norm outputs used in every way the rewrite must tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.a, self.b, self.c, self.d, self.e, self.f = (nn.BatchNorm2d(4) for _ in range(6))
        self.act, self.silu = nn.ReLU(inplace=True), nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act(self.a(self.conv(x)))  # -> ReLU: one layer
        b = self.b(a)
        c = torch.relu(b) + b.mean()  # two users: left alone
        d = nn.functional.relu6(self.d(c))  # -> ReLU6: one layer
        e = torch.relu(self.e(d) + a)  # -> add -> ReLU: one layer, residual a
        f = self.silu(self.f(e))  # -> SiLU: one layer
        return self.c(f) + 1.0  # an add of a number: alone


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(x)) if x.sum() > 0 else self.bn(x)  # data-dependent: does not trace


def test_the_rewrite_folds_only_an_activation_or_an_add_and_relu_that_are_the_only_users() -> None:
    model = _Block().train()
    gm, layers = norm_graph.rewrite(model, lambda bn, relu, res: fused_norm.NormAct(bn, relu, res, set()), fused_norm.eligible)
    by = {id(layer.bn): (layer.act, layer.residual) for layer in layers}
    assert by == {id(model.a): (fused_norm.RELU, False), id(model.b): (fused_norm.NONE, False), id(model.d): (fused_norm.RELU6, False),
                  id(model.e): (fused_norm.RELU, True), id(model.f): (fused_norm.SILU, False), id(model.c): (fused_norm.NONE, False)}
    x = torch.randn(2, 4, 6, 6)
    torch.manual_seed(0)
    want = model(x)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
    assert torch.allclose(gm(x), want, atol=1e-6)  # on the CPU each layer is torch's own ops: the same function
    assert not list(fused_norm.NormAct(model.a, True, False, set()).parameters())  # the model's parameters stay its own
    norms = fused_norm.Norms(_Branchy())
    assert norms.graph is None and len(norms.singles) == 1 and "does not trace" in norms.describe()


def test_it_is_on_by_default_and_says_why_not_where_it_cannot_be(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    on = Options(graphs=True, channels_last=True)
    assert _fuse_norms(cnn, cuda, on) == "" and on.fused_norm and on.as_params()["resolved.fused_norm"] == "true"
    monkeypatch.setenv("MPSRUN_FUSED_NORM", "0")
    off = Options(graphs=True, channels_last=True)
    assert "MPSRUN_FUSED_NORM=0" in _fuse_norms(cnn, cuda, off) and not off.fused_norm
    monkeypatch.delenv("MPSRUN_FUSED_NORM")
    assert "graphs are off" in _fuse_norms(cnn, cuda, Options(graphs=False, channels_last=True))
    assert "channels_last is off" in _fuse_norms(cnn, cuda, Options(graphs=True))
    assert _fuse_norms(cnn, torch.device("cpu"), Options(graphs=True, channels_last=True)) == ""
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    assert _fuse_norms(plain, cuda, Options(graphs=True)) == ""  # no batch-norm: nothing to say
    assert fused_norm.plan(nn.Sequential(nn.BatchNorm2d(4, momentum=None))) is None  # a cumulative average reads a count on the host
    assert fused_norm.plan(nn.Sequential(nn.BatchNorm2d(4, affine=False))) is None


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.conv, self.bn, self.relu = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()
        self.head = nn.Sequential(nn.Conv2d(16, 8, 3), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        return self.head(self.relu(self.bn(self.conv(s)) + s))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the kernels on a GPU)")
def test_graphs_with_the_kernels_train_as_torch_s_batch_norm_cuda() -> None:
    """A small residual CNN, 3 epochs of graph replays (fp32, channels_last, SGD), with the kernels and with torch's
    batch-norm: parameters and running statistics within 1e-3 of each other (on the H100: 2.6e-5 apart on weights of
    about 0.1, fp32 rounding of other summation orders grown over 12 SGD steps with momentum; a wrong gradient moves
    them by far more), and the model plain afterwards. (bf16 and Adam, as the zoo trains, amplify rounding: the last
    bit of a bf16 output, or the sign of a near-zero gradient under Adam, moves a parameter by a whole step; `check`
    and the zoo run cover them.)"""
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
        model = _Residual().to(dev).to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        trainer = GraphTrainer(model, opt, dev, Options(precision="fp32", channels_last=True, graphs=True, fused_norm=norms))
        assert (trainer.norms is not None) == norms
        if norms:
            assert trainer.norms.describe() == "3 batch-norms; activations folded in: 2 ReLU; residual adds folded in: 1"
        plan = BatchPlan(ResidentBatches(x, y, 16, dev, True, 0), ResidentBatches(x[:32], y[:32], 16, dev, False, 0), True, "test")
        trainer.capture(plan)
        for epoch in range(3):
            trainer.train_epoch(plan, epoch, Listener())
        torch.cuda.synchronize()
        assert not any("forward" in m.__dict__ for m in model.modules())
        results.append([t.detach().float().clone() for t in (*model.parameters(), *model.buffers())])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-4), (a - b).abs().max()


def test_a_batch_norm_mismatch_gives_up_the_batch_norm_kernels_first_capture_simulated() -> None:
    """engine._capture_or_eager gives up the kernels whose own check failed, not the first in its table."""
    from mpsrun.train.loop import engine
    from mpsrun.train.loop.events import Listener

    class Notes(Listener):
        def __init__(self) -> None:
            self.notes: list[str] = []

        def on_note(self, message: str, warn: bool = True) -> None:
            self.notes.append(message)

    class Stand:  # what _capture_or_eager reads of a GraphTrainer
        def __init__(self) -> None:
            self.options = Options(graphs=True, channels_last=True, fused_pool=True, fused_norm=True)
            self.graphs, self.pool, self.pools, self.norms, self.calls = {"k": 1}, object(), object(), object(), 0

        def capture(self, plan: object) -> None:
            self.calls += 1
            if self.calls == 1:
                raise fused_norm.Mismatch("batch-norm (2, 4, 5, 5) torch.bfloat16: the input gradient is off")

    stand, listener = Stand(), Notes()
    assert engine._capture_or_eager(stand, None, listener) is stand  # type: ignore[arg-type]
    assert stand.calls == 2 and not stand.options.fused_norm and stand.norms is None
    assert stand.options.fused_pool and stand.pools is not None  # the max-pool kernels stay
    assert listener.notes[0].startswith("norms: torch's batch-norm kernels, not the fused ones (Mismatch before or during capture: batch-norm")


def test_the_check_runs_on_a_few_images_of_the_batch_s_shape() -> None:
    """At the batch's own shape the check's fp32 copies of ResNet18's stem held 4.6 GB more at peak (the H100 run)."""
    assert fused_norm.check_shape((256, 64, 112, 112)) == (6, 64, 112, 112)  # channels and image size kept: the same kernels
    assert fused_norm.check_shape((8, 64, 20, 20)) == (8, 64, 20, 20)  # small batches as they are
    assert fused_norm.check_shape((256, 2048, 64, 64)) == (1, 2048, 64, 64)


def test_a_graph_that_cannot_be_rewritten_leaves_the_batch_norms_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("lint failed")

    monkeypatch.setattr(norm_graph, "rewrite", broken)
    norms = fused_norm.Norms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    assert norms.graph is None and len(norms.singles) == 1
