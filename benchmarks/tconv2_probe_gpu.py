"""GPU probe for helper 12's tconv changes (issue 43): the flattened few-channel forward (bias fused) and the bias
gradient inside the weight-gradient kernel, against cuDNN. Prints a table; writes nothing (Triton's cache goes to a
temporary folder removed at exit, so every kernel compiles fresh: the compile time is in `total s`).

    python3 benchmarks/tconv2_probe_gpu.py            # on the H200 (torch 2.11, Triton 3.6)
    PROBE_FP32=0 python3 benchmarks/tconv2_probe_gpu.py   # bf16 only

Without CUDA it runs tiny shapes in Triton's interpreter (a dry run of the script's own plumbing, no timings worth reading).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

_cache = tempfile.TemporaryDirectory(prefix="probe_tconv2_")
os.environ["TRITON_CACHE_DIR"] = _cache.name
T0 = time.perf_counter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from mpsrun.sweep.fused.kernels import tconv  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
NB = 128 if CUDA else 2
torch.backends.cudnn.benchmark = True
CL = torch.channels_last
ROWS: list[tuple] = []


def timed(fn, iters: int = 30, warm: int = 5) -> float:
    """Milliseconds a call, CUDA events after warm-up (cudnn.benchmark's trials and Triton's compiles are in warm-up)."""
    for _ in range(warm if CUDA else 1):
        fn()
    if not CUDA:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def err(got, ref) -> float:
    if isinstance(got, (tuple, list)):
        return max(err(g, r) for g, r in zip(got, ref))
    ref = ref.float()
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def row(part: str, dtype: torch.dtype, what: str, fn, ref_fn=None) -> float:
    try:
        ms = timed(fn)
        e = err(fn(), ref_fn()) if ref_fn is not None else float("nan")
        ROWS.append((part, str(dtype).replace("torch.", ""), what, f"{ms:.4f}", "" if ref_fn is None else f"{e:.2e}"))
        return ms
    except Exception as ex:  # noqa: BLE001 - a probe: say it and go on
        ROWS.append((part, str(dtype).replace("torch.", ""), what, "ERROR", f"{type(ex).__name__}: {str(ex).splitlines()[0][:120]}"))
        return float("nan")


def rnd(*shape, dtype, cl=False):
    t = torch.randn(*shape, device=DEV).to(dtype)
    return t.contiguous(memory_format=CL) if cl else t


def part_a(dt):
    """(a) the shared first conv: [128,3,32,32] -> 16 members x 32 = 512 filters, 3x3 pad 1, bias."""
    hw = 32 if CUDA else 4
    x = rnd(NB, 3, hw, hw, dtype=dt, cl=True)
    w, b = rnd(16, 32, 3, 3, 3, dtype=dt), rnd(16, 32, dtype=dt)
    wf = w.reshape(512, 3, 3, 3)
    cud = lambda: F.conv2d(x, wf, b.reshape(-1), 1, 1)  # noqa: E731 - cuDNN + the separate bias add
    row("a shared 3->512 3x3", dt, "cuDNN conv2d + bias", cud)
    row("a shared 3->512 3x3", dt, "cuDNN conv2d, no bias", lambda: F.conv2d(x, wf, None, 1, 1))
    base = tconv.CFG["flat"]
    for cfg in ([base, (128, 128, 32, 4), (64, 64, 32, 4), (128, 64, 32, 8)] if dt != torch.float32 else [base]):
        tconv.CFG["flat"] = cfg
        row("a shared 3->512 3x3", dt, f"flat+bias cfg={cfg}{' (default)' if cfg == base else ''}",
            lambda: tconv.conv_fwd(x, wf.unsqueeze(0), b.reshape(1, -1), (1, 1), (1, 1), 1, (1, 1)), cud)
    tconv.CFG["flat"] = base


def part_b(dt):
    """(b) the grouped first layer: 16 members 3 -> 32 at 32x32, own batches [128, 48, 32, 32]."""
    hw = 32 if CUDA else 4
    x = rnd(NB, 48, hw, hw, dtype=dt, cl=True)
    w, b = rnd(16, 32, 3, 3, 3, dtype=dt), rnd(16, 32, dtype=dt)
    cud = lambda: F.conv2d(x, w.reshape(512, 3, 3, 3), b.reshape(-1), 1, 1, 1, 16)  # noqa: E731
    row("b grouped 16x 3->32", dt, "cuDNN grouped + bias", cud)
    row("b grouped 16x 3->32", dt, "flat (conv_fwd now)", lambda: tconv.conv_fwd(x, w, b, (1, 1), (1, 1), 16), cud)
    wr = w.permute(0, 3, 4, 2, 1).contiguous()
    row("b grouped 16x 3->32", dt, "tap kernel (conv_fwd before)", lambda: tconv._implicit(x, wr, b.reshape(-1), (1, 1), (1, 1), 16), cud)
    if dt == torch.float32:
        return
    # the rule's edge (tconv.FLAT_CIN = 16): 8 channels a member, flattened (72 columns: 3 tiles of 32) or a tap at a time (8 -> 16)
    x8 = rnd(NB, 128, hw, hw, dtype=dt, cl=True)
    w8, b8 = rnd(16, 16, 8, 3, 3, dtype=dt), rnd(16, 16, dtype=dt)
    cud8 = lambda: F.conv2d(x8, w8.reshape(256, 8, 3, 3), b8.reshape(-1), 1, 1, 1, 16)  # noqa: E731
    row("b' grouped 16x 8->16", dt, "cuDNN grouped + bias", cud8)
    row("b' grouped 16x 8->16", dt, "flat (conv_fwd now)", lambda: tconv.conv_fwd(x8, w8, b8, (1, 1), (1, 1), 16), cud8)
    wr8 = w8.permute(0, 3, 4, 2, 1).contiguous()
    row("b' grouped 16x 8->16", dt, "tap kernel", lambda: tconv._implicit(x8, wr8, b8.reshape(-1), (1, 1), (1, 1), 16), cud8)


def part_c(dt):
    """(c) weight gradient with the bias gradient in the same pass vs weight gradient + g.sum: shared and grouped."""
    hw = 32 if CUDA else 4
    for name, x, wshape in (("c shared 3->512 3x3", rnd(NB, 3, hw, hw, dtype=dt, cl=True), (1, 512, 3, 3, 3)),
                            ("c grouped 16x 32->64 16x16", rnd(NB, 512, hw // 2, hw // 2, dtype=dt, cl=True), (16, 64, 32, 3, 3))):
        m, cout = wshape[0], wshape[1]
        g = rnd(NB, m * cout, x.shape[2], x.shape[3], dtype=dt, cl=True)
        wf = torch.zeros(m * cout, *wshape[2:], device=DEV, dtype=dt)
        cud = lambda: torch.ops.aten.convolution_backward(g, x, wf, [m * cout], [1, 1], [1, 1], [1, 1], False, [0, 0], m,  # noqa: E731
                                                          [False, True, True])
        ref = lambda: (cud()[1].view(wshape), g.float().sum((0, 2, 3)).view(m, cout))  # noqa: E731
        row(name, dt, "cuDNN wgrad + bias grad", cud)
        row(name, dt, "g.sum((0,2,3)) alone", lambda: g.sum((0, 2, 3)))
        row(name, dt, "wgrad, no bias", lambda: tconv.conv_wgrad(g, x, wshape, (1, 1), (1, 1)), lambda: ref()[0])
        row(name, dt, "wgrad + g.sum (before)", lambda: (tconv.conv_wgrad(g, x, wshape, (1, 1), (1, 1)), g.sum((0, 2, 3)).view(m, cout)), ref)
        row(name, dt, "wgrad(bias=True) (now)", lambda: tconv.conv_wgrad(g, x, wshape, (1, 1), (1, 1), bias=True), ref)


def part_d(dt):
    """(d) a ResNet stem: 3 -> 64, 7x7 stride 2 pad 3, 224x224, batch 64, one member, no bias."""
    hw, nb = (224, 64) if CUDA else (20, 2)
    x = rnd(nb, 3, hw, hw, dtype=dt, cl=True)
    w = rnd(1, 64, 3, 7, 7, dtype=dt)
    cud = lambda: F.conv2d(x, w[0], None, 2, 3)  # noqa: E731
    row("d stem 3->64 7x7 s2", dt, "cuDNN", cud)
    row("d stem 3->64 7x7 s2", dt, "flat", lambda: tconv.conv_fwd(x, w, None, (3, 3), (1, 1), 1, (2, 2)), cud)


def main() -> None:
    dts = [torch.bfloat16] + ([torch.float32] if os.environ.get("PROBE_FP32", "1") != "0" else [])
    torch.backends.cudnn.allow_tf32 = True  # fp32 rows: TF32 on both sides (cuDNN's default; the kernels follow it)
    for dt in dts:
        for part in (part_a, part_b, part_c, part_d):
            part(dt)
    dev = torch.cuda.get_device_name() if CUDA else "CPU (Triton interpreter: a dry run)"
    import triton

    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}, cudnn.benchmark on, fp32 rows TF32; ms a call; "
          "err = max|x - ref| / max|ref| (ref: the part's cuDNN row; bias gradient ref: g.float().sum)")
    w = [max(len(str(r[i])) for r in ROWS + [("part", "dtype", "what", "ms", "err")]) for i in range(5)]
    for r in [("part", "dtype", "what", "ms", "err")] + ROWS:
        print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
    print(f"# total s (fresh compiles included): {time.perf_counter() - T0:.1f}")


if __name__ == "__main__":
    main()
