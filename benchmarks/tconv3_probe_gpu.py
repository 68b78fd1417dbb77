"""GPU probe for helper 12's pipelined conv kernels (issue 43, tpipe.py): the per-tap forward, input gradient and
weight gradient, current kernels vs software-pipelined variants (tconv.CFG["fwd_pipe"/"dgrad_pipe"/"wgrad_pipe"])
vs cuDNN, bf16, on the fused sweep's packed channels_last layout. Prints a table; writes nothing (Triton's cache goes
to a temporary folder removed at exit, so every kernel compiles fresh; compiles run on threads, overlapped).

    python3 benchmarks/tconv3_probe_gpu.py          # on the H200 (torch 2.11, Triton 3.6); < 90 s with compiles
    PROBE_THREADS=0 python3 benchmarks/tconv3_probe_gpu.py   # compiles one after another (if threads misbehave); PROBE_BUDGET_S=85 default

Without CUDA it runs tiny shapes in Triton's interpreter (a dry run of the plumbing, no timings worth reading).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time

_cache = tempfile.TemporaryDirectory(prefix="probe_tconv3_")
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
DT = torch.bfloat16
torch.backends.cudnn.benchmark = True
CL = torch.channels_last
BUDGET_S = float(os.environ.get("PROBE_BUDGET_S", "85"))

# (BP, BCO, BCI, warps, stages) for the forward and the input gradient; (BP, BCO, BK, warps, stages) for the weight gradient.
# BCO/BCI are upper bounds (tconv takes the next power of two of the channels, capped there).
FWD_CFGS = [(128, 64, 32, 4, 3), (128, 64, 32, 4, 4), (128, 64, 32, 8, 3), (64, 64, 32, 4, 3), (128, 128, 64, 8, 3),
            (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 32, 8, 4)]
WGRAD_CFGS = [(64, 64, 32, 4, 3), (64, 64, 32, 4, 4), (128, 64, 32, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 8, 3),
              (128, 128, 64, 8, 3), (32, 64, 32, 4, 4)]
if not CUDA:  # the interpreter's dry run: two of each, one shape, no budget
    FWD_CFGS, WGRAD_CFGS, BUDGET_S = FWD_CFGS[:1] + FWD_CFGS[-1:], WGRAD_CFGS[:2], float("inf")


class _ThreadCfg(dict):
    """tconv.CFG with per-thread overrides, so compiles of different tile choices can run side by side on threads."""

    local = threading.local()

    def __getitem__(self, key):
        over = getattr(self.local, "over", None)
        return over[key] if over and key in over else dict.__getitem__(self, key)


tconv.CFG = _ThreadCfg(tconv.CFG)


def with_cfg(over, fn):
    def run():
        tconv.CFG.local.over = over
        try:
            return fn()
        finally:
            tconv.CFG.local.over = None
    return run


def timed(fn, iters: int = 20, warm: int = 3) -> float:
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


def rnd(*shape, cl=False):
    t = torch.randn(*shape, device=DEV).to(DT)
    return t.contiguous(memory_format=CL) if cl else t


def cases():
    """(name, op, variant, fn, ref_fn) for every shape, op and variant."""
    out = []
    shapes = [("16x 32->64 16x16", 16, 32, 64, 16), ("16x 64->128 8x8", 16, 64, 128, 8), ("64x 32->64 16x16", 64, 32, 64, 16)]
    nb = 128 if CUDA else 2
    for name, m, cin, cout, hw in shapes if CUDA else shapes[1:2]:
        if not CUDA:
            m, hw, cin, cout = 2, 4, 16, 32
        x, g = rnd(nb, m * cin, hw, hw, cl=True), rnd(nb, m * cout, hw, hw, cl=True)
        w, b = rnd(m, cout, cin, 3, 3), rnd(m, cout)
        wf = w.reshape(m * cout, cin, 3, 3)

        def bwd(mask, g=g, x=x, wf=wf, m=m, cout=cout):
            return torch.ops.aten.convolution_backward(g, x, wf, [m * cout], [1, 1], [1, 1], [1, 1], False, [0, 0], m, mask)

        ops = {
            "fwd": (lambda x=x, w=w, b=b, m=m: tconv.conv_fwd(x, w, b, (1, 1), (1, 1), m),
                    lambda x=x, wf=wf, b=b, m=m: F.conv2d(x, wf, b.reshape(-1), 1, 1, 1, m), "fwd_pipe", FWD_CFGS),
            "dgrad": (lambda g=g, w=w, x=x: tconv.conv_dgrad(g, w, tuple(x.shape), (1, 1), (1, 1)),
                      lambda bwd=bwd: bwd([True, False, False])[0], "dgrad_pipe", FWD_CFGS),
            "wgrad+b": (lambda g=g, x=x, w=w: tconv.conv_wgrad(g, x, tuple(w.shape), (1, 1), (1, 1), bias=True),
                        lambda bwd=bwd, w=w, m=m, cout=cout: (lambda r: (r[1].view(w.shape), r[2].view(m, cout)))(bwd([False, True, True])),
                        "wgrad_pipe", WGRAD_CFGS),
        }
        for op, (fn, ref, key, cfgs) in ops.items():
            out.append((name, op, "cuDNN", ref, None))
            out.append((name, op, "current", fn, ref))
            for c in cfgs:
                out.append((name, op, f"pipe {c}", with_cfg({key: c}, fn), ref))
    return out


def main() -> None:
    rows = cases()
    # compile everything first (threads: Triton's compiles overlap; the interpreter runs a launch's grid in a global: inline)
    t = time.perf_counter()
    failed: dict[int, str] = {}

    def first(i):
        try:
            rows[i][3]()
        except Exception as ex:  # noqa: BLE001 - a probe: say it and go on
            failed[i] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:100] if str(ex) else ''}"

    cudnn = [i for i, r in enumerate(rows) if r[2] == "cuDNN"]
    for i in cudnn:  # alone: cudnn.benchmark's choice timed on an idle GPU
        first(i)
    rest = [i for i in range(len(rows)) if i not in cudnn]
    if CUDA and os.environ.get("PROBE_THREADS", "1") != "0":
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(first, rest))
        torch.cuda.synchronize()
    else:
        for i in rest:
            first(i)
    compile_s = time.perf_counter() - t
    table, best, skipped = [], {}, 0
    for i, (name, op, var, fn, ref) in enumerate(rows):
        if i in failed:
            table.append((name, op, var, "ERROR", "", failed[i]))
            continue
        if time.perf_counter() - T0 > BUDGET_S:
            skipped += 1
            continue
        ms = timed(fn)
        e = f"{err(fn(), ref()):.2e}" if ref is not None else ""
        cur = best.setdefault((name, op), {})
        cur[var] = ms
        table.append((name, op, var, f"{ms:.4f}", "", e))
    for r_i, r in enumerate(table):  # speed-up against the current kernel of the same shape and op
        cur = best.get((r[0], r[1]), {}).get("current")
        if cur and r[3] not in ("ERROR",):
            table[r_i] = (*r[:4], f"{cur / float(r[3]):.2f}x", r[5])
    import triton

    dev = torch.cuda.get_device_name() if CUDA else "CPU (Triton interpreter: a dry run)"
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}, bf16, batch 128, 3x3 pad 1, cudnn.benchmark on; "
          "ms a call (CUDA events, 20 calls after 3); speed = current kernel's ms / this row's; err = max|x - cuDNN| / max|cuDNN|")
    head = ("shape", "op", "variant", "ms", "speed", "err vs cuDNN")
    w = [max(len(str(r[i])) for r in table + [head]) for i in range(6)]
    for r in [head] + table:
        print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
    print("# best a shape and op:")
    for (name, op), d in best.items():
        var = min((v for v in d if v != "cuDNN"), key=d.get)
        print(f"  {name:18} {op:8} {var:28} {d[var]:.4f} ms (current {d.get('current', float('nan')):.4f}, cuDNN {d.get('cuDNN', float('nan')):.4f})")
    print(f"# compiles (threads, 8): {compile_s:.1f} s; skipped for the {BUDGET_S:.0f} s budget: {skipped} rows; "
          f"total s: {time.perf_counter() - T0:.1f}")


if __name__ == "__main__":
    main()
