"""The fused Linear (+ ReLU) layers (train/kernels/fused_linear.py): their arithmetic, and when a run uses them.

The kernels run here in Triton's CPU interpreter (TRITON_INTERPRET=1, a child process, with
`fits` widened to CPU tensors); on a CUDA machine the `_cuda` test runs the compiled kernels
against torch's, inside a CUDA graph as the engine replays them.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from mpsrun.train.assemble import _fuse_layers
from mpsrun.train.kernels import fused_linear
from mpsrun.train.loop.steps import Options
from tests.proc_helpers import in_triton_interpreter

CHECK = """
import copy, json, torch
from torch import nn
from mpsrun.train.kernels import fused_linear as fl
fl.fits = lambda x, layer: x.dim() == 2 and torch.is_grad_enabled()  # the interpreter runs on CPU tensors
torch.manual_seed(0)
out = []
# (widths, rows, last bias): several tiles and a ragged edge; 784 inputs as fashion's; a batch under one tile, no last bias
for dims, rows, last_bias in [([50, 40, 30, 10], 20, True), ([784, 64, 10], 64, True), ([17, 33, 5], 3, False)]:
    layers = [nn.Flatten()]
    for a, b in zip(dims[:-2], dims[1:-1]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    layers.append(nn.Linear(dims[-2], dims[-1], bias=last_bias))
    mine = nn.Sequential(*layers)
    ref = copy.deepcopy(mine).double()
    x = torch.randn(rows, dims[0])
    y = fl.plan(mine)(x)
    y.square().sum().backward()
    y2 = ref(x.double())
    y2.square().sum().backward()
    dg = max(((p.grad.double() - q.grad).abs().max() / q.grad.abs().max()).item() for p, q in zip(mine.parameters(), ref.parameters()))
    out.append(["mlp", dims, rows, (y.double() - y2).abs().max().item() / y2.abs().max().item(), dg, y.dtype == torch.float32])
# the input's gradient through a ReLU made before the fused layer (its mask applied in the backward kernel)
z = torch.randn(8, 20, requires_grad=True)
lin = nn.Linear(20, 12)
fl.linear(torch.relu(z), lin, relu=True, in_relu=True).sum().backward()
z2 = z.detach().double().requires_grad_()
lin2 = copy.deepcopy(lin).double()
torch.relu(lin2(torch.relu(z2))).sum().backward()
out.append(["in_relu", (z.grad.double() - z2.grad).abs().max().item(), (lin.weight.grad.double() - lin2.weight.grad).abs().max().item(),
            (lin.bias.grad.double() - lin2.bias.grad).abs().max().item()])
# NaN goes through the fused ReLU as through torch.relu: a diverging run is still seen as one
out.append(["nan", bool(torch.isnan(fl.linear(torch.full((2, 20), float("nan")), lin, relu=True)).all())])
# split-K forwards leave their tile counters zeroed (a graph replays the kernel with the same buffer) and give the same bits again
x = torch.randn(64, 784)
lin = nn.Linear(784, 64)
site = {}
first = fl.linear(x, lin, relu=True, site=site)
again = fl.linear(x, lin, relu=True, site=site)
out.append(["split", fl.split_k(8, 784, fl.FWD["BK"])[0], all(int(c.abs().sum()) == 0 for c in site.values()) and len(site) > 0,
            bool(torch.equal(first, again))])
# the check before capture passes on these kernels and catches a kernel that is 1% off
p = fl.plan(nn.Sequential(nn.Flatten(), nn.Linear(30, 20), nn.ReLU(), nn.Linear(20, 20), nn.ReLU(), nn.Linear(20, 4)))
p.check(7)
good = sorted(p.checked)
orig = fl._forward
fl._forward = lambda x, w, b, relu, site=None: orig(x, w, b, relu, site) * 1.01
p.checked.clear()
try:
    p.check(7)
    caught = ""
except fl.Mismatch as e:
    caught = str(e)
out.append(["check", good, caught])
print(json.dumps(out))
"""


def test_fused_linear_matches_torch_in_tritons_interpreter() -> None:
    rows = in_triton_interpreter(CHECK)
    assert [row[0] for row in rows] == ["mlp", "mlp", "mlp", "in_relu", "nan", "split", "check"]
    for _, dims, n, dy, dg, fp32 in rows[:3]:
        assert dy < 1e-5 and dg < 1e-5 and fp32, (dims, n, dy, dg)  # fp32 against fp64: rounding only
    _, dz, dw, db = rows[3]
    assert dz < 1e-5 and dw < 1e-5 and db < 1e-5, rows[3]
    assert rows[4][1] is True
    assert rows[5][1] > 1 and rows[5][2] is True and rows[5][3] is True, rows[5]  # split in parts; counters zero; same bits
    assert rows[6][1] == [7] and rows[6][2].startswith("layer 1 (30->20, 7 rows): output differs from torch's by 1.0e-02"), rows[6]


def test_the_kernels_compile_for_an_h100_without_one() -> None:
    """Triton compiles for sm_90 here (its own ptxas): a kernel that only the GPU machine would reject fails on CI."""
    triton = pytest.importorskip("triton", reason="Triton is not installed here")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:  # pragma: no cover - an older Triton's layout
        pytest.skip("this Triton has no ASTSource/GPUTarget")
    k = fused_linear._build()

    def sig(fn: object, consts: dict) -> dict:
        return {n: "constexpr" if n in consts else "*fp32" if n.endswith("_ptr") else "i32" for n in fn.arg_names}  # type: ignore[attr-defined]

    f, w, x = fused_linear.FWD, fused_linear.BWD_W, fused_linear.BWD_X
    for relu in (True, False):
        for split in (1, 4):
            c = dict(HAS_BIAS=True, RELU=relu, BM=f["BM"], BN=f["BN"], BK=f["BK"], SPLIT=split, PREC="ieee")
            s = sig(k["fwd"], c)
            s["c_ptr"] = "*i32"
            triton.compile(ASTSource(fn=k["fwd"], signature=s, constexprs=c), target=GPUTarget("cuda", 90, 32), options={"num_warps": f["warps"]})
        for in_relu, want_x in ((False, False), (True, True)):
            c = dict(RELU=relu, IN_RELU=in_relu, HAS_BIAS=True, WANT_X=want_x, WN=w["BN"], WK=w["BK"], WM=w["BM"], XM=x["BM"], XK=x["BK"], XN=x["BN"], PREC="ieee")
            triton.compile(ASTSource(fn=k["bwd"], signature=sig(k["bwd"], c), constexprs=c), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the kernels compiled for a GPU)")
def test_fused_linear_cuda_graph_replays_what_torch_computes() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(dev)
    import copy

    ref = copy.deepcopy(model).double()
    assert fused_linear.why_not(model, dev, "fp32", True, False, 64) is None
    fwd = fused_linear.plan(model)
    for rows in (64, 256, 3):  # the engine's check before capture, at the batch sizes a run uses
        fwd.check(rows)
    x = torch.randn(64, 1, 28, 28, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fwd(x).square().sum().backward()  # warm-up: the kernels compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    for p in model.parameters():
        p.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fwd(x)
        out.square().sum().backward()
    g.replay()
    torch.cuda.synchronize()
    want = ref(x.double())
    want.square().sum().backward()
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    for p, q in zip(model.parameters(), ref.parameters()):
        assert ((p.grad.double() - q.grad).abs().max() / q.grad.abs().max()).item() < 1e-5


def test_without_cuda_the_planned_forward_is_the_models_own() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 3))
    x = torch.randn(5, 3, 4)
    a = fused_linear.plan(model)(x)
    a.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    b = model(x)
    b.sum().backward()
    assert torch.equal(a, b)  # the CPU falls back to torch's own ops: the same bits
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_why_not_names_each_reason_and_stays_quiet_where_nothing_is_expected() -> None:
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert fused_linear.why_not(mlp, torch.device("cpu"), "fp32", True, False, 64) == ""
    assert fused_linear.why_not(nn.Conv2d(1, 1, 3), cuda, "fp32", True, False, 64) == ""  # no Linear layers to fuse

    class Scaled(nn.Sequential):  # a plugin's Sequential with its own forward: walking its children would skip it
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x * 2)

    assert fused_linear.why_not(Scaled(nn.Linear(4, 2)), cuda, "fp32", True, False, 64) == ""
    assert "precision bf16" in fused_linear.why_not(mlp, cuda, "bf16", True, False, 64)
    assert "graphs are off" in fused_linear.why_not(mlp, cuda, "fp32", False, False, 64)
    assert "compile" in fused_linear.why_not(mlp, cuda, "fp32", True, True, 64)
    assert "batch 1024" in fused_linear.why_not(mlp, cuda, "fp32", True, False, 1024)
    h = mlp[1].register_forward_hook(lambda *a: None)
    assert "hooks" in fused_linear.why_not(mlp, cuda, "fp32", True, False, 64)
    h.remove()
    mlp[3].bias.requires_grad_(False)
    assert "trainable" in fused_linear.why_not(mlp, cuda, "fp32", True, False, 64)


def test_a_cuda_run_turns_them_on_and_the_knob_off_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton", reason="Triton is not installed here")
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    on = Options(graphs=True)
    assert _fuse_layers(mlp, torch.device("cuda"), on, 64) == ""
    assert on.fused_linear and on.as_params()["resolved.fused_linear"] == "true"
    monkeypatch.setenv("MPSRUN_FUSED_LINEAR", "0")
    off = Options(graphs=True)
    note = _fuse_layers(mlp, torch.device("cuda"), off, 64)
    assert not off.fused_linear and note == "layers: torch's Linear kernels, not the fused ones (MPSRUN_FUSED_LINEAR=0)"
    cpu = Options(graphs=False)
    assert _fuse_layers(mlp, torch.device("cpu"), cpu, 64) == "" and not cpu.fused_linear


def test_a_cuda_run_of_a_model_without_fusable_layers_says_nothing_of_them() -> None:
    """A ResNet on CUDA (its classifier is one Linear inside a model of its own forward) once
    carried "not the fused ones ()" in its notes: a note with no reason, for nothing a user expects."""
    cuda = torch.device("cuda")  # a device object only: nothing runs on it

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = nn.Conv2d(1, 2, 3), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.conv(x).mean((2, 3)))

    for model in (Net(), nn.Sequential(nn.Conv2d(1, 1, 3))):
        options = Options(graphs=True)
        assert _fuse_layers(model, cuda, options, 64) == "" and not options.fused_linear
