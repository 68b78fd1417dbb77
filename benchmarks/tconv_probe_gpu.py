"""GPU probe for sweep/fused/tconv.py (untracked scratch; run from the repo root: python tconv_probe_gpu.py).

Times the Triton convolutions against cuDNN and the present packed._wgrad on the issue-43 CNN shapes,
prints errors, first-call (compile) times, a few tile choices, and the packed 16-member step with and
without the kernels. Writes everything to $OUT/tconv.txt as it goes (a timeout keeps what was written).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, "src")
from mpsrun.sweep.fused import packed, tconv  # noqa: E402

DRY = os.environ.get("TCONV_PROBE_DRY") == "1"  # a CPU dry run of the probe's own code (TRITON_INTERPRET=1, tiny shapes)
OUT = os.environ.get("OUT", "/tmp" if DRY else ".")
LOG = open(os.path.join(OUT, "tconv.txt"), "w")
T0 = time.time()


def say(*a: object) -> None:
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.write(line + "\n")
    LOG.flush()


def bench(fn, reps: int = 50, warm: int = 5) -> float:  # noqa: ANN001
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def first_call(fn) -> float:  # noqa: ANN001
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def err(a: torch.Tensor, r: torch.Tensor) -> str:
    d = (a.float() - r.float()).abs()
    return f"max_abs {float(d.max()):.3g} rel_to_max {float(d.max() / r.float().abs().max()):.3g}"


dev = torch.device("cpu" if DRY else "cuda")
torch.backends.cudnn.benchmark = True
torch.backends.cudnn.allow_tf32 = True
say(f"device {dev if DRY else torch.cuda.get_device_name()} torch {torch.__version__} triton {__import__('triton').__version__}")


def grouped(dtype: torch.dtype, m: int = 16, n: int = 128, cin: int = 32, cout: int = 64, hw: int = 16, sweep: bool = True) -> None:
    if DRY:
        m, n, hw = 2, 2, 4
    say(f"\n== conv2 grouped: M={m} N={n} Cin={cin} Cout={cout} {hw}x{hw} 3x3 p1, {dtype} (cudnn.allow_tf32={torch.backends.cudnn.allow_tf32})")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, m * cin, hw, hw, device=dev, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(m, cout, cin, 3, 3, device=dev, generator=gen) * 0.1).to(dtype)
    b = torch.randn(m, cout, device=dev, generator=gen).to(dtype)
    wf = w.reshape(m * cout, cin, 3, 3)
    g = torch.randn(n, m * cout, hw, hw, device=dev, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    pad, dil, one = (1, 1), (1, 1), (1, 1)
    fns = {
        "tconv fwd": lambda: tconv.conv_fwd(x, w, b, pad, dil, m),
        "tconv dgrad": lambda: tconv.conv_dgrad(g, w, tuple(x.shape), pad, dil),
        "tconv wgrad": lambda: tconv.conv_wgrad(g, x, tuple(w.shape), pad, dil, one),
    }
    for k, f in fns.items():
        say(f"  first call (compile) {k}: {first_call(f):.2f} s")
    ref_y = F.conv2d(x, wf, b.reshape(-1), 1, 1, 1, m)
    ref_gx, ref_gw, _ = torch.ops.aten.convolution_backward(g, x, wf, None, [1, 1], [1, 1], [1, 1], False, [0, 0], m, [True, True, False])
    with packed._matmul_like_conv(g):
        old_gw = packed._wgrad(g, x, tuple(w.shape), one, pad, dil)
    say(f"  fwd   tconv vs cuDNN: {err(fns['tconv fwd'](), ref_y)}")
    say(f"  dgrad tconv vs cuDNN: {err(fns['tconv dgrad'](), ref_gx)}")
    say(f"  wgrad tconv vs cuDNN: {err(fns['tconv wgrad'](), ref_gw.view(w.shape))}; present _wgrad vs cuDNN: {err(old_gw, ref_gw.view(w.shape))}")
    xi, wi, gi = x.double(), w.double(), g.double()  # fp64 truth (CUDA fp64 conv, no TF32)
    t_y = F.conv2d(xi, wi.reshape(m * cout, cin, 3, 3), b.double().reshape(-1), 1, 1, 1, m)
    say(f"  fwd vs fp64: tconv {err(fns['tconv fwd'](), t_y)}; cuDNN {err(ref_y, t_y)}")
    t_gw = torch.ops.aten.convolution_backward(gi, xi, wi.reshape(m * cout, cin, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], m,
                                               [False, True, False])[1].view(w.shape)
    say(f"  wgrad vs fp64: tconv {err(fns['tconv wgrad'](), t_gw)}; cuDNN {err(ref_gw.view(w.shape), t_gw)}; _wgrad {err(old_gw, t_gw)}")

    def old_w() -> torch.Tensor:
        with packed._matmul_like_conv(g):
            return packed._wgrad(g, x, tuple(w.shape), one, pad, dil)

    rows = [("fwd", fns["tconv fwd"], lambda: F.conv2d(x, wf, b.reshape(-1), 1, 1, 1, m)),
            ("dgrad", fns["tconv dgrad"], lambda: torch.ops.aten.convolution_backward(g, x, wf, None, [1, 1], [1, 1], [1, 1], False, [0, 0], m,
                                                                                      [True, False, False])),
            ("wgrad", fns["tconv wgrad"], lambda: torch.ops.aten.convolution_backward(g, x, wf, None, [1, 1], [1, 1], [1, 1], False, [0, 0], m,
                                                                                       [False, True, False])),
            ("wgrad (present _wgrad)", None, old_w)]
    for name, mine, theirs in rows:
        t_mine = bench(mine) if mine is not None else float("nan")
        say(f"  {name:24s} tconv {t_mine:7.3f} ms   cuDNN/present {bench(theirs):7.3f} ms")
    if not sweep:
        return
    # a few tile choices (each compiles once)
    base = dict(tconv.CFG)
    for cfg in [(128, 64, 32, 4), (128, 64, 32, 8), (64, 64, 32, 8)]:
        tconv.CFG["fwd"] = cfg
        try:
            c = first_call(fns["tconv fwd"])
            say(f"  fwd cfg {cfg}: {bench(fns['tconv fwd'], 20):.3f} ms fwd, {bench(fns['tconv dgrad'], 20):.3f} ms dgrad (compile {c:.1f} s)")
        except Exception as e:  # noqa: BLE001
            say(f"  fwd cfg {cfg}: failed {type(e).__name__}: {str(e)[:200]}")
    tconv.CFG.update(base)
    for cfg, progs in [((64, 64, 64, 4), 1024), ((128, 64, 32, 4), 1024), ((64, 64, 32, 8), 1024), ((64, 64, 32, 4), 2048)]:
        tconv.CFG["wgrad"], tconv.WGRAD_PROGRAMS = cfg, progs
        try:
            c = first_call(fns["tconv wgrad"])
            say(f"  wgrad cfg {cfg} programs {progs}: {bench(fns['tconv wgrad'], 20):.3f} ms (compile {c:.1f} s)")
        except Exception as e:  # noqa: BLE001
            say(f"  wgrad cfg {cfg}: failed {type(e).__name__}: {str(e)[:200]}")
    tconv.CFG.update(base)
    tconv.WGRAD_PROGRAMS = 1024


def dense(dtype: torch.dtype, n: int = 128, cin: int = 3, cout: int = 512, hw: int = 32, sweep: bool = True) -> None:
    if DRY:
        n, hw = 2, 4
    say(f"\n== conv1 dense weight gradient: N={n} Cin={cin} Cout={cout} {hw}x{hw} 3x3 p1, {dtype}")
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(n, cin, hw, hw, device=dev, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(cout, cin, 3, 3, device=dev, generator=gen).to(dtype)
    g = torch.randn(n, cout, hw, hw, device=dev, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    mine = lambda: tconv.conv_wgrad(g, x, (1, cout, cin, 3, 3), (1, 1), (1, 1), (1, 1))  # noqa: E731
    theirs = lambda: torch.ops.aten.convolution_backward(g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])  # noqa: E731
    say(f"  first call (compile) tconv wgrad: {first_call(mine):.2f} s")
    say(f"  wgrad tconv vs cuDNN: {err(mine().view(w.shape), theirs()[1])}")
    say(f"  wgrad tconv {bench(mine):7.3f} ms   cuDNN {bench(theirs):7.3f} ms")
    if not sweep:
        return
    base = dict(tconv.CFG)
    for cfg, progs in [((64, 64, 32, 4), 2048), ((128, 64, 32, 4), 1024), ((64, 128, 32, 8), 1024)]:
        tconv.CFG["wgrad"], tconv.WGRAD_PROGRAMS = cfg, progs
        try:
            c = first_call(mine)
            say(f"  wgrad cfg {cfg} programs {progs}: {bench(mine, 20):.3f} ms (compile {c:.1f} s)")
        except Exception as e:  # noqa: BLE001
            say(f"  wgrad cfg {cfg}: failed {type(e).__name__}: {str(e)[:200]}")
    tconv.CFG.update(base)
    tconv.WGRAD_PROGRAMS = 1024


PROFILE = True  # the graphed tconv step's kernels (torch.profiler), once per dtype


def step(dtype: torch.dtype, m: int = 16, bs: int = 128) -> None:
    """The packed fused step (forward + backward, no optimizer) of 16 small-CNN members sharing a batch, eager and graphed."""
    from mpsrun.sweep.fused.layers import Stacked

    if DRY:
        m, bs = 2, 2
    say(f"\n== packed step: {m} members, batch {bs}, CNN 3->32->64 (3x3 p1, maxpool 2 after each), {dtype}")
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 8 * 8, 10)).to(dev) for _ in range(m)]
    xin = torch.randn(1, bs, 3, 32, 32, device=dev).expand(m, bs, 3, 32, 32)
    y = torch.randint(0, 10, (bs,), device=dev)
    grads = {}
    for use in (False, True):
        st = Stacked(models)
        st.pack, st.channels_last = True, True
        said: list[str] = []
        st.pools = packed.FastPools(st.layers, said.append)
        st.convs = tconv.Convs(said.append) if use else None

        def one() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                out = st(xin)
            loss = F.cross_entropy(out.float().reshape(-1, 10), y.repeat(m))
            loss.backward()

        t_eager = bench(one, 20, 3)
        grads[use] = [p.grad.clone() for p in st.params]
        for p in st.params:
            p.grad = None
        if DRY:
            say(f"  {'tconv' if use else 'cuDNN + _wgrad'}: eager {t_eager:.3f} ms; said {said}")
            continue
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                one()
        torch.cuda.current_stream().wait_stream(side)
        t_graph = float("nan")
        try:
            gph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gph):
                one()
            t_graph = bench(gph.replay, 50, 3)
        except Exception as e:  # noqa: BLE001
            say(f"  capture failed: {type(e).__name__}: {str(e)[:300]}")
        if PROFILE and use:
            try:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        gph.replay()
                    torch.cuda.synchronize()
                say("  graphed tconv step, 5 replays, CUDA kernels by time:")
                say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
            except Exception as e:  # noqa: BLE001
                say(f"  profile failed: {type(e).__name__}: {str(e)[:200]}")
        kinds = sorted({k[0] for k in st.convs.checked}) if use else []
        say(f"  {'tconv' if use else 'cuDNN + _wgrad'}: eager {t_eager:.3f} ms, graphed {t_graph:.3f} ms; kernels used for {kinds}; said {said}")
    errs = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads[True], grads[False])]
    say(f"  grads (accumulated over the eager reps) tconv vs cuDNN, rel to max: {['%.2g' % e for e in errs]}")


PLAN = [(grouped, (torch.float32, False)), (grouped, (torch.bfloat16, False)), (dense, (torch.float32, False)), (dense, (torch.bfloat16, False)),
        (step, (torch.float32,)), (step, (torch.bfloat16,)),
        # then the tile choices (each a compile), while time is left
        (grouped, (torch.bfloat16, True)), (dense, (torch.bfloat16, True)), (grouped, (torch.float32, True)), (dense, (torch.float32, True))]
for fn, args in PLAN:
    if len(args) > 1 and args[1] and time.time() - T0 > 120:
        say(f"\n(skipped {fn.__name__}{args}: past 120 s)")
        continue
    try:
        fn(*args) if fn is step else fn(args[0], sweep=args[1])
    except Exception:  # noqa: BLE001
        say(traceback.format_exc()[-2000:])
    say(f"  [{time.time() - T0:.0f} s so far]")
if time.time() - T0 < 150:
    torch.backends.cudnn.allow_tf32 = False
    try:
        grouped(torch.float32, sweep=False)  # exact fp32 ("ieee") against cuDNN's fp32
    except Exception:  # noqa: BLE001
        say(traceback.format_exc()[-2000:])
say(f"done in {time.time() - T0:.0f} s")
