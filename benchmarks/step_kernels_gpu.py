"""Where a schedule and clipping cost time inside a CUDA-graphed step (issue 13, item 10).

The fashion recipe's step (784-512-512-10 MLP, batch 64, SGD) replayed as graphs of
16 steps, as train/loop/steps.py does, in variants that add one thing at a time:

- base: torch SGD (foreach) with a float rate: what the recipe trains with today;
- lr:tensorsgd: the rate a device tensor, through train/schedulers.TensorLRSGD;
- lr:fused: torch SGD(fused=True) reading the tensor rate in its one kernel;
- clip:torch: torch.nn.utils.clip_grad_norm_ (foreach) + the running max of the norm;
- clip:mpsrun: Objective.clip's torch path (clip_grad_norm_ + running max);
- clip:fast: train/clipping.FastClip (one Triton kernel, one foreach multiply);
- clip:fold: train/clip_sgd.ClipSGD, the clip folded into SGD's own kernel (one launch;
  `split`: the same code in two launches; `b1024`/`b4096`: other block sizes; `plain launch`: not a cooperative grid);
- combinations.

`--profile` also prints the CUDA kernels of a few replays of the base and folded graphs
(torch.profiler), to say where the step's time goes.

Each variant replays REPLAYS graphs after a warm-up; median of ROUNDS interleaved
rounds; prints microseconds per step and the ratio to base.

    python benchmarks/step_kernels_gpu.py [--rounds 5] [--replays 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, "src")
from mpsrun.train.controls import clipping  # noqa: E402
from mpsrun.train.loop.objective import Objective  # noqa: E402
from mpsrun.train.controls.schedulers import late_momentum_buffers, tensor_lr  # noqa: E402

K, B = 16, 64


def name_of(lr_mode: str, clip_mode: str) -> str:
    return f"lr={lr_mode} clip={clip_mode}:"


def build(lr_mode: str, clip_mode: str, dev: torch.device) -> tuple[Callable[[], None], tuple]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(dev)
    if lr_mode == "fused":
        opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(1e-3, device=dev), fused=True)
    elif lr_mode == "fusedfloat":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=True)
    else:
        # "tensor": what a run with a schedule builds (runner.build_optimizer: fused on CUDA) and controls.py does
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=lr_mode == "tensor")
        if lr_mode == "tensor":
            opt.register_step_pre_hook(late_momentum_buffers)
        if lr_mode in ("tensorsgd", "tensor"):
            tensor_lr(opt, dev)
    obj = Objective.default(dev)
    if clip_mode != "none":
        obj.max_norm = 1.0
        obj.grad_norm = torch.zeros((), device=dev)
    if clip_mode == "fast":
        print(name_of(lr_mode, clip_mode), obj.attach(model, dev, False, 1))
    if clip_mode.startswith("fold"):  # ClipSGD: the kernel's launch mode and block size from the variant's name
        mode = 1 if "split" in clip_mode else 0
        block = 1024 if "b1024" in clip_mode else 4096 if "b4096" in clip_mode else 2048

        class Knobs(clipping.TritonKernels):
            def clip_sgd(self, *a, **k):  # type: ignore[no-untyped-def]
                return super().clip_sgd(*a, mode=mode, block=block, **k)

        knobs = Knobs()
        if "plain" in clip_mode:  # an ordinary launch instead of a cooperative grid
            knobs._cooperative = {}
        print(name_of(lr_mode, clip_mode), obj.attach(model, dev, False, 1, kernels=knobs, optimizer=opt), knobs._cooperative)
    loss_sum = torch.zeros((), device=dev)
    xs = torch.rand(K, B, 1, 28, 28, device=dev)
    ys = torch.randint(0, 10, (K, B), device=dev)

    def clip() -> None:
        if clip_mode == "torch":
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            torch.maximum(obj.grad_norm, total.detach().float(), out=obj.grad_norm)
        elif clip_mode in ("mpsrun", "fast") or clip_mode.startswith("fold"):
            obj.clip(model)
        elif clip_mode == "lean":
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            torch.maximum(obj.grad_norm, total, out=obj.grad_norm)
            torch._foreach_mul_(grads, 1.0 / torch.clamp(total, min=1.0))  # max_norm 1.0
        elif clip_mode == "cat":
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            total = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
            torch.maximum(obj.grad_norm, total, out=obj.grad_norm)
            torch._foreach_mul_(grads, 1.0 / torch.clamp(total, min=1.0))
        elif clip_mode == "normonly":
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            torch.maximum(obj.grad_norm, total, out=obj.grad_norm)

    def step(j: int) -> None:
        loss = nn.functional.cross_entropy(model(xs[j]), ys[j])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clip()
        opt.step()
        loss_sum.add_(loss.detach().float(), alpha=B)

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            step(0)
    torch.cuda.current_stream(dev).wait_stream(side)
    opt.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(K):
            step(j)
    return g.replay, (g, model, opt, obj, loss_sum, xs, ys)  # the graph reads these: keep them alive


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true", help="also list the CUDA kernels of the base and folded graphs")
    a = ap.parse_args()
    dev = torch.device("cuda")
    variants = [
        ("base", "float", "none"),
        ("lr:tensorsgd", "tensorsgd", "none"),
        ("lr:fused", "fused", "none"),
        ("clip:torch", "float", "torch"),
        ("clip:mpsrun", "float", "mpsrun"),
        ("lr:tensorsgd+clip:mpsrun", "tensorsgd", "mpsrun"),
        ("lr:fused+clip:mpsrun", "fused", "mpsrun"),
        ("clip:lean", "float", "lean"),
        ("clip:cat", "float", "cat"),
        ("clip:normonly", "float", "normonly"),
        ("lr:fused+clip:lean", "fused", "lean"),
        ("clip:fast (foreach SGD)", "float", "fast"),
        ("clip:fast (fused SGD)", "fusedfloat", "fast"),
        ("lr:fused+clip:fast", "fused", "fast"),
        ("lr:tensor (controls.py)", "tensor", "none"),
        ("lr:tensor+clip:fold (controls.py)", "tensor", "fold"),
        ("lr:tensor+clip:fold plain launch", "tensor", "fold plain"),
        ("lr:tensor+clip:fold split", "tensor", "foldsplit"),
        ("lr:tensor+clip:fold b1024", "tensor", "fold b1024"),
        ("lr:tensor+clip:fold b4096", "tensor", "fold b4096"),
        ("clip:fold (float rate)", "float", "fold"),
    ]
    graphs = {name: build(lr, clip, dev) for name, lr, clip in variants}
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for _ in range(a.rounds):
        for name, _, _ in variants:
            replay = graphs[name][0]
            for _ in range(10):
                replay()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(a.replays):
                replay()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t) / (a.replays * K) * 1e6)
    base = statistics.median(times["base"])
    lines = [f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; us per graphed step, median of {a.rounds} rounds x {a.replays} replays of {K} steps", "",
             "| variant | us/step | vs base |", "| --- | --- | --- |"]
    for name, _, _ in variants:
        m = statistics.median(times[name])
        lines.append(f"| {name} | {m:.1f} | {m / base:.3f}x |")
    # Same data, same number of replays: variants that clip must agree with torch's clip, the rest with base.
    def flat(name: str) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in graphs[name][1][1].parameters()])
    lines += ["", "| variant | max abs parameter difference from its reference |", "| --- | --- |"]
    for name, _, clip in variants:
        ref = "clip:torch" if clip not in ("none", "normonly") else "base"
        lines.append(f"| {name} (vs {ref}) | {(flat(name) - flat(ref)).abs().max().item():.2e} |")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        for name in ("base", "lr:tensor (controls.py)", "lr:fused+clip:fast", "lr:tensor+clip:fold (controls.py)"):
            replay = graphs[name][0]
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    replay()
                torch.cuda.synchronize()
            lines += ["", f"### {name}: CUDA kernels of 10 replays ({10 * K} steps)", "```",
                      prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70), "```"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
