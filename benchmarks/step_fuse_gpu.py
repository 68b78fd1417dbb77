"""Fewer kernels in the fashion step (issue 27, item 3): which fusion pays inside CUDA graphs.

The fashion recipe's training step (uint8 28x28 -> affine -> 784-512-512-10 MLP, batch
64, cross-entropy, SGD with a tensor rate as mpsrun builds it) replayed as graphs of 16
steps, as train/loop/steps.py does, in variants that change one thing at a time:

- ref: what mpsrun trains with today (F.cross_entropy, nn.ReLU, fused SGD, loss sum add);
- ce: cross-entropy forward and backward as one Triton kernel each
  (train/kernels/fused_ce.py), the loss sum folded into the forward kernel;
- relu: Linear + ReLU forward as one cuBLASLt call with a ReLU epilogue
  (`torch._addmm_activation`), backward as torch's ops;
- compile: the loss function compiled by inductor (for scale: what compile would buy);
- addcmul: the uint8 batch straight into addcmul (no separate cast kernel);
- lt: cuBLASLt preferred for the GEMMs (`torch.backends.cuda.preferred_blas_library`);
- tf32: TF32 tensor-core GEMMs (for scale only: an fp32 recipe keeps fp32 GEMMs);
- mlp: each Linear (+ ReLU) one Triton kernel forward and one backward (train/kernels/fused_linear.py),
  `mlp:NAME[@P]` with one of TILES' tile sizes (and about P programs for a split forward); `mlp3` the same with three TF32 tensor-core products
  (Triton's tf32x3) instead of IEEE fp32 FMAs, for scale;
- combinations.

Prints microseconds per step, the ratio to ref, the largest parameter difference from ref
after the same replays (same data, same order), and with --profile the CUDA kernels of ref
and the best variant.

    python benchmarks/step_fuse_gpu.py [--rounds 5] [--replays 200] [--profile] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, "src")

K, B = 16, 64

# fused_linear tile sizes to try: forward (rows, outputs, reduction, warps), weight gradient, input gradient
TILES = {
    "a": ((16, 32, 32, 2), (32, 64, 16, 4), (16, 32, 32, 2)),
    "b": ((16, 16, 64, 2), (64, 64, 16, 4), (16, 16, 64, 2)),
    "c": ((32, 32, 32, 4), (32, 32, 32, 4), (32, 32, 32, 4)),
    "d": ((16, 64, 32, 4), (64, 32, 16, 4), (16, 64, 32, 4)),
    "e": ((16, 16, 32, 1), (32, 32, 16, 2), (16, 16, 32, 1)),
    "f": ((32, 16, 32, 2), (32, 64, 32, 4), (32, 16, 32, 2)),
    "g": ((16, 32, 64, 4), (32, 64, 32, 4), (16, 32, 64, 4)),
    "h": ((32, 64, 32, 4), (64, 64, 32, 8), (32, 64, 32, 4)),
    "i": ((16, 16, 128, 4), (16, 64, 64, 4), (16, 16, 128, 4)),
    "j": ((16, 32, 32, 2), (64, 64, 16, 4), (16, 16, 64, 2)),
    "k": ((16, 16, 32, 1), (64, 64, 16, 4), (16, 16, 64, 2)),
    "l": ((32, 32, 32, 4), (64, 64, 16, 4), (16, 16, 64, 2)),
    "m": ((16, 16, 64, 2), (64, 64, 16, 4), (16, 16, 64, 2)),
}


class LinearReLU(nn.Linear):
    """nn.Linear whose forward applies ReLU in the GEMM's epilogue (same parameters, same keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return torch._addmm_activation(self.bias, x, self.weight.t())


def model_for(relu: bool, dev: torch.device) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(dev)
    if relu:
        for i in (1, 3):
            lin = LinearReLU(m[i].in_features, m[i].out_features, device=dev)
            lin.load_state_dict(m[i].state_dict())
            m[i] = lin
            m[i + 1] = nn.Identity()
    return m


def build(variant: str, dev: torch.device) -> tuple[Callable[[], None], Any]:
    relu = "relu" in variant
    torch.backends.cuda.preferred_blas_library("cublaslt" if "lt" in variant.split("+") else "cublas")
    torch.backends.cuda.matmul.allow_tf32 = "tf32" in variant  # for scale only: fp32 recipes keep fp32 GEMMs
    model = model_for(relu, dev)
    lr = torch.tensor(1e-3, device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=lr, fused=True)
    loss_sum = torch.zeros((), device=dev)
    g0 = torch.Generator(device="cpu").manual_seed(1)
    xs = torch.randint(0, 256, (K, B, 1, 28, 28), generator=g0, dtype=torch.uint8).to(dev)
    ys = torch.randint(0, 10, (K, B), generator=g0).to(dev)
    a = torch.full((1, 1, 1, 1), 1 / 255 / 0.353, device=dev)
    b = torch.full((1, 1, 1, 1), -0.286 / 0.353, device=dev)
    if "ce" in variant:
        from mpsrun.train.kernels import fused_ce

        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return fused_ce.cross_entropy(logits, y, loss_sum)
    elif "compile" in variant:
        ce = torch.compile(lambda lg, y: nn.functional.cross_entropy(lg, y), dynamic=False)

        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = ce(logits, y)
            loss_sum.add_(loss.detach(), alpha=B)
            return loss
    else:
        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(logits, y)
            loss_sum.add_(loss.detach().float(), alpha=B)
            return loss

    forward: Callable[[torch.Tensor], torch.Tensor] = model
    if "mlp" in variant:
        from mpsrun.train.kernels import fused_linear as fl

        name = variant.split(":")[1] if ":" in variant else "a"  # mlp:NAME[@PROGRAMS]
        name, _, programs = name.partition("@")
        fl.PROGRAMS = int(programs or 256)
        tiles = TILES[name]
        for d, t in zip((fl.FWD, fl.BWD_W, fl.BWD_X), tiles):
            d.update(zip(("BM", "BN", "BK", "warps") if d is not fl.BWD_W else ("BN", "BK", "BM", "warps"), t))
        fl.PRECISION = "tf32x3" if "mlp3" in variant else "ieee"
        forward = fl.plan(model)

    def step(j: int) -> None:
        x = torch.addcmul(b, xs[j], a) if "addcmul" in variant else xs[j].float() * a + b
        loss = loss_fn(forward(x), ys[j])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            step(0)
    torch.cuda.current_stream(dev).wait_stream(side)
    # undo warm-up so every variant starts from the same parameters
    fresh = model_for(relu, dev)
    with torch.no_grad():
        for p, q in zip(model.parameters(), fresh.parameters()):
            p.copy_(q)
    loss_sum.zero_()
    opt.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(K):
            step(j)
    # everything the graph reads stays alive with it (a, b and the fused layers' counters were freed here once:
    # the last-built variant then replayed on reused memory and did not train)
    return g.replay, (g, model, opt, loss_sum, xs, ys, a, b, forward, lr)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--variants", default="ref,addcmul,ce,ce+addcmul,lt,ce+addcmul+lt,tf32")
    ap.add_argument("--out")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--profile-also", default="", help="more variants to profile with --profile (comma-separated)")
    ap.add_argument("--barrier", default="", help="DIR:N: after building, wait until N processes are ready in DIR, then time (benchmarks/share_step_gpu.py)")
    a = ap.parse_args()
    global B
    B = a.batch
    dev = torch.device("cuda")
    names = a.variants.split(",")
    graphs: dict[str, Any] = {}
    lines: list[str] = []
    for n in names:
        try:
            t0 = time.perf_counter()
            graphs[n] = build(n, dev)
            lines.append(f"built {n} in {time.perf_counter() - t0:.2f} s")
        except Exception as e:  # a variant this torch cannot do: say so, go on
            lines.append(f"variant {n} failed: {type(e).__name__}: {str(e)[:300]}")
    ok = [n for n in names if n in graphs]
    # same replays from the same start for the parity table
    for n in ok:
        for _ in range(50):
            graphs[n][0]()
    torch.cuda.synchronize()
    if a.barrier:  # processes sharing the GPU time the same seconds
        import os
        from pathlib import Path

        where, _, count = a.barrier.rpartition(":")
        Path(where, f"ready-{os.getpid()}").touch()
        deadline = time.time() + 300
        while len(list(Path(where).glob("ready-*"))) < int(count) and time.time() < deadline:
            time.sleep(0.005)
    times: dict[str, list[float]] = {n: [] for n in ok}
    for _ in range(a.rounds):
        for n in ok:
            replay = graphs[n][0]
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(a.replays):
                replay()
            torch.cuda.synchronize()
            times[n].append((time.perf_counter() - t) / (a.replays * K) * 1e6)
    ref = statistics.median(times["ref"]) if "ref" in times else 1.0
    lines += ["", f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; us per graphed step, median of {a.rounds} rounds x {a.replays} replays of {K} steps", "",
              "| variant | us/step | vs ref | max abs param diff vs ref (after the same 50 replays + timing) | loss sum vs ref |", "| --- | --- | --- | --- | --- |"]

    def flat(n: str) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in graphs[n][1][1].parameters()])

    for n in ok:
        m = statistics.median(times[n])
        d = (flat(n) - flat("ref")).abs().max().item() if "ref" in graphs else float("nan")
        ls = graphs[n][1][3].item() / max(graphs["ref"][1][3].item(), 1e-30) if "ref" in graphs else float("nan")
        lines.append(f"| {n} | {m:.1f} | {m / ref:.3f}x | {d:.2e} | {ls:.6f} |")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        best = min(ok, key=lambda n: statistics.median(times[n]))
        for n in dict.fromkeys(["ref", best, *filter(None, a.profile_also.split(","))]):
            if n not in graphs:
                continue
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    graphs[n][0]()
                torch.cuda.synchronize()
            lines += ["", f"### {n}: CUDA kernels of 10 replays ({10 * K} steps)", "```",
                      prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=80), "```"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
