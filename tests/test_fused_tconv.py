"""The fused sweep's Triton convolutions (sweep/fused/tconv.py): their answers, their check, and when a group uses them.

The kernels run here in Triton's CPU interpreter (TRITON_INTERPRET=1, a child process; tconv.fits takes CPU
tensors, so the same Functions run). On a CUDA machine the `_cuda` test trains a packed CNN's fused step with the
kernels and with cuDNN's convolutions.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpsrun.sweep.fused.kernels import convcheck, tconv
from tests.proc_helpers import in_triton_interpreter

CHECK = """
import json, torch
import torch.nn.functional as F
from torch import nn
from mpsrun.sweep.fused.kernels import convcheck, tconv
from mpsrun.sweep.fused.layers import Stacked
torch.backends.cudnn.allow_tf32 = False  # exact fp32 products ("ieee")
gen = torch.Generator().manual_seed(0)
out = {"kernels": [], "stacked": [], "pipe": []}
# (M, N, Cin, Cout, H, W, K, padding, dilation, stride, bias, dtype)
CASES = [(2, 2, 3, 16, 5, 7, 3, 1, 1, 1, True, torch.float32), (3, 1, 8, 16, 7, 6, 5, 2, 2, 1, False, torch.float32),
         (1, 2, 32, 64, 4, 5, 1, 0, 1, 1, True, torch.float32), (2, 1, 8, 16, 6, 6, 3, 0, 1, 1, True, torch.float32),
         (2, 2, 3, 16, 7, 5, 3, 2, 2, 1, True, torch.float32), (2, 2, 8, 16, 5, 6, 3, 1, 1, 1, True, torch.bfloat16),
         (2, 2, 8, 16, 7, 9, 3, 1, 1, 2, False, torch.float32), (1, 2, 3, 64, 6, 6, 3, 1, 1, 1, False, torch.float32),
         # 16 channels and more: the weight gradient a tap at a time (contiguous channel blocks)
         (2, 1, 16, 16, 6, 5, 3, 2, 2, 1, False, torch.float32), (1, 2, 32, 16, 7, 6, 3, 1, 1, 2, True, torch.float32),
         (2, 1, 32, 16, 5, 5, 3, 1, 1, 1, True, torch.bfloat16),
         # fewer than 16 channels: the flattened forward (conv_flat_k) at any stride; 7x7 over 3 channels is 5 column tiles
         (1, 2, 1, 16, 9, 9, 7, 3, 1, 2, True, torch.bfloat16), (3, 1, 2, 8, 8, 7, 1, 0, 1, 2, False, torch.float32),
         (2, 2, 3, 16, 11, 10, 7, 3, 2, 2, True, torch.float32), (1, 1, 8, 16, 7, 7, 3, 2, 1, 2, True, torch.bfloat16)]
def run(cases, into):
    for m, n, cin, cout, h, w, k, p, d, s, bias, dt in cases:
        x = torch.randn(n, m * cin, h, w, generator=gen).to(dt).contiguous(memory_format=torch.channels_last)
        wt = torch.randn(m, cout, cin, k, k, generator=gen).to(dt)
        b = torch.randn(m, cout, generator=gen).to(dt) if bias else None
        xr, wr = x.float().requires_grad_(), wt.float().requires_grad_()
        ref = F.conv2d(xr, wr.reshape(-1, cin, k, k), b.float().reshape(-1) if bias else None, s, p, d, groups=m)
        g = torch.randn(ref.shape, generator=gen).to(dt).contiguous(memory_format=torch.channels_last)
        rgx, rgw = torch.autograd.grad(ref, (xr, wr), g.float())
        got = {"wgrad": (tconv.conv_wgrad(g, x, tuple(wt.shape), (p, p), (d, d), (s, s)), rgw)}
        if bias:  # the bias gradient from the weight gradient's pass, which must stay the same
            gw, gb = tconv.conv_wgrad(g, x, tuple(wt.shape), (p, p), (d, d), (s, s), bias=True)
            got["wgrad+b"], got["bgrad"] = (gw, rgw), (gb, g.float().sum((0, 2, 3)).view(m, cout))
        if tconv.forward_ok(cin, (s, s)):
            got["fwd"] = (tconv.conv_fwd(x, wt, b, (p, p), (d, d), m, (s, s)), ref)
        if s == 1:
            got["dgrad"] = (tconv.conv_dgrad(g, wt, tuple(x.shape), (p, p), (d, d)), rgx)
        errs = {}
        for what, (a, r) in got.items():
            layout = a.dim() != 4 or a.is_contiguous(memory_format=torch.channels_last)
            errs[what] = [list(a.shape) == list(r.shape), str(a.dtype), layout, float((a.float() - r).abs().max() / r.abs().max())]
        into.append([str(dt), errs])
run(CASES, out["kernels"])
# tpipe's pipelined variants (tconv.CFG[*_pipe]): the per-tap forward from 16 channels, every stride-1 input gradient, the
# per-tap weight gradient; tiles smaller than a member's channels (several channel blocks a tap) and one tile for all
for cfg in ((32, 16, 16, 4, 2), (64, 64, 64, 8, 3)):
    tconv.CFG["fwd_pipe"] = tconv.CFG["dgrad_pipe"] = tconv.CFG["wgrad_pipe"] = cfg
    run([c for c in CASES if c[2] >= 16] + [CASES[1]], out["pipe"])
tconv.CFG["fwd_pipe"] = tconv.CFG["dgrad_pipe"] = tconv.CFG["wgrad_pipe"] = None
# rows and columns apart (a 3x5 filter, stride (2, 1), padding (1, 2), dilation (1, 2)): a crossed axis is caught
x = torch.randn(2, 6, 9, 11, generator=gen).contiguous(memory_format=torch.channels_last)
wt, b = torch.randn(2, 16, 3, 3, 5, generator=gen), torch.randn(2, 16, generator=gen)
ref = F.conv2d(x, wt.reshape(-1, 3, 3, 5), b.reshape(-1), (2, 1), (1, 2), (1, 2), groups=2)
out["asym"] = float((tconv.conv_fwd(x, wt, b, (1, 2), (1, 2), 2, (2, 1)) - ref).abs().max() / ref.abs().max())
# each check passes at a grouped shape and at a dense first layer's
convcheck.check("grouped", (2, 16, 6, 5), (2, 16, 8, 3, 3), torch.float32, torch.device("cpu"), (1, 1), (1, 1), (1, 1))
convcheck.check("shared", (2, 3, 6, 5), (1, 32, 3, 3, 3), torch.float32, torch.device("cpu"), (1, 1), (1, 1), (1, 1))
convcheck.check("shared", (2, 3, 11, 10), (1, 48, 3, 7, 7), torch.bfloat16, torch.device("cpu"), (2, 2), (3, 3), (1, 1))
# a packed CNN's step with the kernels and with torch's convolutions: members sharing a batch (a dense first
# convolution) and members with their own batches (every convolution grouped)
torch.manual_seed(0)
# (a strided 3-channel first convolution: the flattened forward, dense with its bias fused, or grouped)
models = [nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, stride=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(16, 16, 1), nn.Flatten(), nn.Linear(16 * 4 * 4, 3)) for _ in range(3)]
said = []
for shared in (True, False):
    xin = torch.randn(4, 3, 16, 16, generator=gen)
    xs = xin.expand(3, *xin.shape) if shared else torch.randn(3, 4, 3, 16, 16, generator=gen)
    res = []
    for use in (True, False):
        st = Stacked(models)
        st.pack, st.channels_last = True, True
        st.convs = convcheck.Convs(said.append) if use else None
        y = st(xs)
        y.square().sum().backward()
        res.append([y.detach()] + [p.grad for p in st.params])
        if use:
            kinds = sorted({k[0] for k in st.convs.checked})
    errs = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(*res)]
    out["stacked"].append([shared, kinds, max(errs)])
out["said"] = said
print(json.dumps(out))
"""


def test_the_kernels_give_torch_s_convolutions_in_triton_s_interpreter() -> None:
    out = in_triton_interpreter(CHECK)
    assert len(out["kernels"]) == 15 and len(out["pipe"]) == 10
    for dtype, errs in out["kernels"] + out["pipe"]:
        # bf16: the output's rounding (the interpreter rounds toward zero: one bf16 step, 2**-7 of the value at most)
        tol = 1e-5 if dtype == "torch.float32" else 1e-2
        for what, (same_shape, got_dtype, channels_last, err) in errs.items():
            assert same_shape and channels_last, (dtype, what)
            assert got_dtype == (dtype if what in ("fwd", "dgrad") else "torch.float32"), (dtype, what)  # weight, bias gradients in fp32
            assert err <= tol, (dtype, what, err)
    assert sum("fwd" in e for _, e in out["kernels"]) == 9  # no forward at stride 2 from 16 channels, nor from 5 to 15 (cuDNN's)
    assert sum("dgrad" in e for _, e in out["kernels"]) == 9  # the input gradient: stride 1 only
    assert sum("bgrad" in e for _, e in out["kernels"]) == 10
    assert [sorted(e) for _, e in out["pipe"][:5]] == [sorted(k) for k in (["wgrad", "wgrad+b", "bgrad", "fwd", "dgrad"],
            ["wgrad", "fwd", "dgrad"], ["wgrad", "wgrad+b", "bgrad"], ["wgrad", "wgrad+b", "bgrad", "fwd", "dgrad"],
            ["wgrad", "dgrad"])]  # the last: 8 channels, its forward cuDNN's (tconv.forward_ok)
    for shared, kinds, err in out["stacked"]:
        assert kinds == (["grouped", "shared"] if shared else ["grouped"])  # every convolution went through the kernels
        assert err <= 1e-5, (shared, err)
    assert out["said"] == []
    assert out["asym"] <= 1e-5


def _torch_kernels(monkeypatch: pytest.MonkeyPatch, wrong: str = "") -> None:
    """tconv's three kernels as torch's grouped convolution (the check's own plumbing runs without Triton), `wrong` one off."""
    def fwd(x, w, b, padding, dilation, m, stride=(1, 1)):  # noqa: ANN001, ANN202
        y = F.conv2d(x, w.reshape(-1, *w.shape[2:]), b.reshape(-1) if b is not None else None, stride, padding, dilation, groups=m)
        return -y if wrong == "fwd" else y

    def dgrad(g, w, xshape, padding, dilation):  # noqa: ANN001, ANN202
        gx = torch.ops.aten.convolution_backward(g, torch.empty(xshape), w.reshape(-1, *w.shape[2:]), None, [1, 1], list(padding),
                                                 list(dilation), False, [0, 0], w.shape[0], [True, False, False])[0]
        return gx.roll(1, 3) if wrong == "dgrad" else gx

    def wgrad(g, x, wshape, padding, dilation, stride=(1, 1), bias=False):  # noqa: ANN001, ANN202
        gw = torch.ops.aten.convolution_backward(g, x, torch.empty(wshape).reshape(-1, *wshape[2:]), None, list(stride), list(padding),
                                                 list(dilation), False, [0, 0], wshape[0], [False, True, False])[1].view(wshape)
        gw = gw * 1.05 if wrong == "wgrad" else gw
        gb = g.sum((0, 2, 3)).view(wshape[0], -1)
        return (gw, -gb if wrong == "bgrad" else gb) if bias else gw

    monkeypatch.setattr(tconv, "conv_fwd", fwd)
    monkeypatch.setattr(tconv, "conv_dgrad", dgrad)
    monkeypatch.setattr(tconv, "conv_wgrad", wgrad)


@pytest.mark.parametrize("wrong", ["fwd", "dgrad", "wgrad", "bgrad"])
def test_a_kernel_that_is_off_is_caught_by_the_check_and_the_group_says_so(monkeypatch: pytest.MonkeyPatch, wrong: str) -> None:
    """`check` is what stands between a wrong kernel and a run: each of the four results is compared, for a dense first
    convolution (strided, few channels: the flattened forward with its bias) as for a grouped one."""
    _torch_kernels(monkeypatch)
    args = ((2, 32, 6, 5), (2, 16, 16, 3, 3), torch.float32, torch.device("cpu"), (1, 1), (1, 1), (1, 1))
    shared = ((2, 3, 9, 8), (1, 32, 3, 7, 7), torch.float32, torch.device("cpu"), (2, 2), (3, 3), (1, 1))
    convcheck.check("grouped", *args)  # right kernels pass
    convcheck.check("shared", *shared)
    _torch_kernels(monkeypatch, wrong)
    what = {"fwd": "output", "dgrad": "input gradient", "wgrad": "weight gradient", "bgrad": "bias gradient"}[wrong]
    with pytest.raises(convcheck.Mismatch, match=what):
        convcheck.check("grouped", *args)
    if wrong != "dgrad":  # a shared batch needs no input gradient: cuDNN's where one is asked
        with pytest.raises(convcheck.Mismatch, match=what):
            convcheck.check("shared", *shared)
    said: list[str] = []
    convs = convcheck.Convs(said.append)
    x = torch.randn(2, 32, 6, 5).contiguous(memory_format=torch.channels_last)
    w = torch.randn(2, 16, 16, 3, 3)
    assert not convs.use("grouped", x, w, (1, 1), (1, 1), (1, 1))  # cuDNN's from here on, for every shape
    assert convs.off and len(said) == 1 and said[0].startswith("convolutions: cuDNN's for this group") and what in said[0]
    assert not convs.use("grouped", x[:1], w, (1, 1), (1, 1), (1, 1)) and len(said) == 1  # said once


def test_a_shape_first_met_in_a_capture_takes_cudnn_and_a_checked_one_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    _torch_kernels(monkeypatch)
    convs = convcheck.Convs(lambda s: None)
    x = torch.randn(2, 16, 6, 5).contiguous(memory_format=torch.channels_last)
    w = torch.randn(2, 16, 8, 3, 3)
    assert not convs.use("grouped", x.contiguous(), w, (1, 1), (1, 1), (1, 1))  # not channels_last: not for the kernels
    assert not convs.use("grouped", x, w.bfloat16(), (1, 1), (1, 1), (1, 1))  # dtypes apart
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cuda_like = _CudaLike(x)
    assert not convs.use("grouped", cuda_like, w, (1, 1), (1, 1), (1, 1)) and not convs.checked  # unchecked in a capture: cuDNN's
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert convs.use("grouped", x, w, (1, 1), (1, 1), (1, 1)) and len(convs.checked) == 1
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert convs.use("grouped", x, w, (1, 1), (1, 1), (1, 1))  # checked before: the kernels, also in a capture


class _CudaLike(torch.Tensor):
    """A CPU tensor that reports is_cuda (only `use`'s capture test reads it)."""

    def __new__(cls, t: torch.Tensor) -> "_CudaLike":
        return t.as_subclass(cls)  # type: ignore[return-value]

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_why_not_says_when_a_group_keeps_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton", reason="Triton is not installed here")
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    layers = [nn.Conv2d(3, 4, 3), nn.ReLU()]
    assert convcheck.why_not(layers, cuda, True) is None
    assert convcheck.why_not(layers, torch.device("cpu"), True) == "not a CUDA channels_last group"
    assert convcheck.why_not(layers, cuda, False) == "not a CUDA channels_last group"
    assert convcheck.why_not([nn.Linear(2, 2)], cuda, True) == "no convolution"
    assert convcheck.why_not(layers, cuda, True, torch.float16) is None
    # fp32 (TF32): only few-channel layers take them (measured faster than cuDNN's there, slower elsewhere)
    assert convcheck.why_not(layers, cuda, True, torch.float32) is None  # `layers` starts with a 3-channel convolution
    assert "many input channels" in (convcheck.why_not([nn.Conv2d(32, 64, 3)], cuda, True, torch.float32) or "")
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        assert "without TF32" in (convcheck.why_not(layers, cuda, True, torch.float32) or "")
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    fp32 = convcheck.Convs(lambda s: None, half=False)
    x32 = torch.randn(2, 64, 6, 5).contiguous(memory_format=torch.channels_last)
    assert not fp32.use("grouped", x32, torch.randn(2, 16, 32, 3, 3), (1, 1), (1, 1), (1, 1)) and not fp32.pending  # many channels: cuDNN's
    monkeypatch.setenv("MPSRUN_FUSED_CONV", "off")
    assert convcheck.why_not(layers, cuda, True) == "MPSRUN_FUSED_CONV=0"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the kernels compiled for a GPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # what a group runs them in (convcheck.why_not: fp32 groups keep cuDNN's)
def test_a_packed_cnn_step_with_the_kernels_is_as_close_as_cudnn_s_cuda(dtype: torch.dtype) -> None:
    """16 members of a small CNN (shared batch: a dense first convolution; then grouped ones), one forward and
    backward with the kernels and with cuDNN's convolutions, each against exact fp32 (cuDNN, TF32 off): the kernels'
    loss and gradients as close to it as cuDNN's own at this precision (TF32 / bf16 rounding, in another order),
    every convolution through the kernels, nothing said. A wrong tap, sign or member is off by the values' order."""
    from mpsrun.sweep.fused.layers import Stacked

    dev = torch.device("cuda")
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                            nn.MaxPool2d(2), nn.Conv2d(64, 16, 5, padding=4, dilation=2), nn.Flatten(), nn.Linear(16 * 8 * 8, 10)).to(dev)
              for _ in range(16)]
    gen = torch.Generator(device=dev).manual_seed(0)
    tf32 = torch.backends.cudnn.allow_tf32
    try:
        for shared in (True, False):
            xin = torch.randn(16 if not shared else 1, 64, 3, 32, 32, device=dev, generator=gen)
            xs = xin.expand(16, *xin.shape[1:]) if shared else xin
            res, said = [], []
            for use, half, exact in ((False, False, True), (True, dtype == torch.bfloat16, False), (False, dtype == torch.bfloat16, False)):
                torch.backends.cudnn.allow_tf32 = not exact
                st = Stacked(models)
                st.pack, st.channels_last = True, True
                st.convs = convcheck.Convs(said.append) if use else None
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=half):
                    y = st(xs)
                y.float().square().mean().backward()
                res.append([y.detach().float()] + [p.grad.float() for p in st.params])
                if use:
                    assert {k[0] for k in st.convs.checked} == ({"grouped", "shared"} if shared else {"grouped"})
            assert said == []
            ref, got, cudnn = res
            for i, (r, a, c) in enumerate(zip(ref, got, cudnn)):
                scale = r.abs().max()
                err, base = float((a - r).abs().max() / scale), float((c - r).abs().max() / scale)
                assert err <= 2 * base + 1e-4, (shared, i, err, base)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def test_a_kernel_triton_cannot_build_leaves_the_group_on_cudnn_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU the tiles do not fit (Triton's OutOfResources at compile) or a Triton that cannot compile them: the check
    raises something other than Mismatch; the group must go on with cuDNN's convolutions, said once, not fail its trials."""
    def cannot_build(*a: object, **k: object) -> None:
        raise RuntimeError("out of resource: shared memory, Required: 263168, Hardware limit: 232448\nmore lines")

    monkeypatch.setattr(convcheck, "check", cannot_build)
    said: list[str] = []
    convs = convcheck.Convs(said.append)
    x = torch.randn(2, 16, 6, 5).contiguous(memory_format=torch.channels_last)
    w = torch.randn(2, 16, 8, 3, 3)
    assert not convs.use("grouped", x, w, (1, 1), (1, 1), (1, 1))
    assert convs.off == "RuntimeError: out of resource: shared memory, Required: 263168, Hardware limit: 232448"
    assert said == [f"convolutions: cuDNN's for this group, not the fused Triton kernels ({convs.off})"]
    assert not convs.use("shared", x, w[:1], (1, 1), (1, 1), (1, 1)) and len(said) == 1  # said once; cuDNN's from here on
