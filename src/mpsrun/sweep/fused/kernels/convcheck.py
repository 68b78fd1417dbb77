"""Where a fused group's convolutions run through tconv's Triton kernels: each shape checked against cuDNN once,
outside any capture, and said when they are not used (why_not, a mismatch, a kernel Triton cannot build).

Why apart from tconv.py: the kernels and their launches are one job, deciding where they may run another.
The check calls the kernels through the tconv module (`tconv.conv_fwd`, ...), so a test can stand wrong ones in.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch

from mpsrun.sweep.fused.kernels import tconv
from mpsrun.sweep.fused.kernels.checked import Checked
from mpsrun.sweep.fused.kernels.tconv import fits

class Mismatch(RuntimeError):
    """The kernels disagreed with cuDNN at a shape: the group goes on with cuDNN's convolutions (said)."""


HALF = (torch.bfloat16, torch.float16)


def why_not(layers: list[torch.nn.Module], device: torch.device, channels_last: bool, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None where a packed group's convolutions can run through these kernels; else why not (the group's note).

    `dtype`: what the convolutions compute in (the group's autocast dtype, else fp32). Half precision takes every
    kernel: on an H200 in bf16 each of the three took 0.14-0.16 ms against cuDNN's 0.29-0.36 and the unfolded weight
    gradient's 0.91. An fp32 group takes them only for few-channel layers (`Convs.use`; TF32 where cuDNN would use
    it): there the flattened forward with its bias took 0.23 ms against cuDNN's 0.35 (a dense 3 -> 512 first layer)
    and the weight and bias gradients 0.28 against 0.37, where the per-tap TF32 kernels lost (16 members 32 -> 64:
    forward 0.52-0.85 ms against 0.46, weight gradient 0.99 against 0.55)."""
    if device.type != "cuda" or not channels_last:
        return "not a CUDA channels_last group"
    if not any(isinstance(m, torch.nn.Conv2d) for m in layers):
        return "no convolution"
    if dtype not in HALF and not torch.backends.cudnn.allow_tf32:
        return "an fp32 group without TF32 (torch.backends.cudnn.allow_tf32 off): cuDNN's exact fp32 convolutions"
    if dtype not in HALF and not any(isinstance(m, torch.nn.Conv2d) and few(m.in_channels // m.groups) for m in layers):
        return "an fp32 group whose convolutions all have many input channels: cuDNN's TF32 ones measured faster on an H200"
    from mpsrun.train.kernels import kernels_off

    return kernels_off("MPSRUN_FUSED_CONV")


def few(cin: int) -> bool:
    """Few input channels a member (an RGB or grey image): the flattened kernels, which beat cuDNN's in TF32 too."""
    return cin < tconv.FLAT_CIN


def _tol(dtype: torch.dtype) -> float:
    """How far from cuDNN, relative to the largest reference value, still counts as the same convolution.
    TF32 and bf16 round each product's inputs to 10 and 7 mantissa bits (cuDNN does too, in another order);
    a wrong kernel (a lost tap, a sign, a member's channels crossed) is off by the order of the values."""
    if dtype != torch.float32:
        return 3e-2
    return 1e-2 if torch.backends.cudnn.allow_tf32 else 1e-4


def check(kind: str, xshape: tuple, wshape: tuple, dtype: torch.dtype, device: torch.device, stride: tuple, padding: tuple,
          dilation: tuple, has_bias: bool = True) -> None:
    """The kernels against cuDNN (aten's convolution and its backward) on random inputs of this shape; raises Mismatch.

    kind "grouped": forward (tconv.forward_ok), input gradient (stride 1), weight and bias gradients of a member-grouped
    convolution; "shared": the same of one dense convolution (wshape's M is 1) but the input gradient (cuDNN's).
    A private generator: the run's random streams are untouched. The kernels are called as the run will call them (bias or not): each variant
    Triton compiles here, never inside a CUDA graph capture."""
    gen = torch.Generator(device=device).manual_seed(0)
    m, cout, cin, kh, kw = wshape
    x = torch.randn(xshape, device=device, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(wshape, device=device, generator=gen).to(dtype)
    b = torch.randn(m, cout, device=device, generator=gen).to(dtype) if has_bias else None
    wf = w.reshape(m * cout, cin, kh, kw)
    groups = m if kind == "grouped" else 1
    bench = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False  # a reference, not the run's kernels: no time-trials of cuDNN's at shapes it will not run
    try:
        got = _against_cudnn(kind, x, w, b, wf, wshape, xshape, stride, padding, dilation, groups, gen)
    finally:
        torch.backends.cudnn.benchmark = bench
    _compare(kind, xshape, wshape, dtype, got)


def _against_cudnn(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, wf: torch.Tensor, wshape: tuple, xshape: tuple,
                   stride: tuple, padding: tuple, dilation: tuple, groups: int, gen: torch.Generator) -> list:
    """(what, the kernel's answer, cuDNN's) for each part the run will take from the kernels at this shape.

    Each kernel runs on its own thread while cuDNN's references run here: a kernel's first call compiles it
    (1-2 s on an H200), and Triton's compiles overlap (kernels/checked.py). The device is synchronised around them:
    the threads run on their own (default) streams, the caller perhaps on a warm-up's side stream."""
    from concurrent.futures import ThreadPoolExecutor

    m = wshape[0]
    dtype, device = x.dtype, x.device
    with torch.autocast(device.type, enabled=False):
        ref = torch.ops.aten.convolution(x, wf, b.reshape(-1) if b is not None else None, list(stride), list(padding), list(dilation), False, [0, 0], groups)
        g = torch.randn(ref.shape, device=device, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
        parts: dict[str, Any] = {"wgrad": lambda: tconv.conv_wgrad(g, x, wshape, padding, dilation, stride, bias=b is not None)}
        if tconv.forward_ok(wshape[2], stride):  # "shared": wshape is [1, M*Cout, ...], its bias [1, M*Cout]
            parts["fwd"] = lambda: tconv.conv_fwd(x, w, b, padding, dilation, m, stride)
        if kind == "grouped" and tuple(stride) == (1, 1):
            parts["dgrad"] = lambda: tconv.conv_dgrad(g, w, xshape, padding, dilation)
        _sync(device)

        def one(f: Any) -> Any:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                return f()

        # threads on CUDA only: Triton's CPU interpreter (the tests) keeps one launch's grid in a global
        with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="mpsrun-conv-check") if device.type == "cuda" else _Inline() as ex:
            futures = {k: ex.submit(one, f) for k, f in parts.items()}
            rgx, rgw, _ = torch.ops.aten.convolution_backward(g, x, wf, None, list(stride), list(padding), list(dilation), False, [0, 0],
                                                              groups, [True, True, False])
            out = {k: f.result() for k, f in futures.items()}
        _sync(device)
        if b is not None:  # the bias gradient from the weight gradient's kernel, as the run takes it
            gw, gb = out["wgrad"]
            got = [("weight gradient", gw, rgw.view(wshape)), ("bias gradient", gb, g.float().sum((0, 2, 3)).view(m, -1))]
        else:
            got = [("weight gradient", out["wgrad"], rgw.view(wshape))]
        if "fwd" in out:
            got.append(("output", out["fwd"], ref))
        if "dgrad" in out:
            got.append(("input gradient", out["dgrad"], rgx))
    return got


class _Inline:
    """An executor that runs each call at once, on this thread (the interpreter's)."""

    def __enter__(self) -> "_Inline":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def submit(self, f: Any, *args: Any) -> Any:
        from concurrent.futures import Future

        fut: Future = Future()
        try:
            fut.set_result(f(*args))
        except Exception as e:  # noqa: BLE001 - raised by result(), as a thread's would be
            fut.set_exception(e)
        return fut


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compare(kind: str, xshape: tuple, wshape: tuple, dtype: torch.dtype, got: list) -> None:
    for what, a, r in got:
        scale = r.float().abs().max().clamp_min(1e-30)
        err = float((a.float() - r.float()).abs().max() / scale) if a.shape == r.shape else float("inf")
        if not err <= _tol(dtype):  # a NaN fails too
            raise Mismatch(f"conv {kind} x{tuple(xshape)} w{tuple(wshape)} {dtype}: the {what} is {err:.2g} from cuDNN's (relative to its largest)")


@contextlib.contextmanager
def timed_check(what: str, device: torch.device) -> Iterator[None]:
    """Under MPSRUN_SWEEP_TRACE, one `sweep-trace-check` line a shape: a check's seconds (a first compile of a kernel
    by Triton, cuDNN's reference), the part of a fused group's first epoch that is neither warm-up nor capture."""
    from mpsrun.sweep import trace

    if not trace.enabled():
        yield
        return
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    trace.emit(f"sweep-trace-check {what} s={time.perf_counter() - t0:.3f}")


class Convs(Checked):
    """A packed group's convolutions through these kernels, each shape checked once outside any capture.

    `use` says whether a call may take the kernels: never at a shape first met during a CUDA graph capture
    (cuDNN's then, not a guess), never after a mismatch or a kernel Triton could not build for this GPU (the group
    then says so through `say`, once, and trains on with cuDNN's: a compile error is no reason to fail a trial)."""

    fallback = "convolutions: cuDNN's for this group, not the fused Triton kernels"
    mismatch = (Mismatch,)

    def __init__(self, say: Callable[[str], None], half: bool = True) -> None:
        super().__init__(say)
        self.half = half  # fp32 (TF32) groups: only few-channel layers (why_not)

    def use(self, kind: str, x: torch.Tensor, w: torch.Tensor, stride: tuple, padding: tuple, dilation: tuple, has_bias: bool = True) -> bool:
        if self.off is not None or not fits(x) or w.dtype != x.dtype or not (self.half or few(w.shape[2])):
            return False
        n, _, h, wd = x.shape
        oh, ow = tconv._out(h, w.shape[3], padding[0], dilation[0], stride[0]), tconv._out(wd, w.shape[4], padding[1], dilation[1], stride[1])
        if oh < 1 or ow < 1 or n * w.shape[0] * w.shape[1] * oh * ow >= 2**31:  # the output (grad_out) too: 32-bit offsets
            return False
        key = (kind, tuple(x.shape), tuple(w.shape), x.dtype, tuple(stride), tuple(padding), tuple(dilation),
               bool(torch.backends.cudnn.allow_tf32), has_bias)
        xs, ws, dtype, device = tuple(x.shape), tuple(w.shape), x.dtype, x.device

        def run() -> None:
            with timed_check(f"conv kind={kind} x={xs} w={ws} bias={int(has_bias)}", device):
                check(kind, xs, ws, dtype, device, stride, padding, dilation, has_bias)

        return self.ready(key, run, x.is_cuda)
