"""fused_norm's batch-norm (+ add + ReLU) kernels against torch's ops, layer by layer, at ResNet18's shapes.

Forward and backward of every batch-norm layer of ResNet18 at batch 256, 224x224, bf16, channels_last,
each as the model uses it (batch-norm -> ReLU, batch-norm -> add -> ReLU, or batch-norm alone), timed
with CUDA events over captured CUDA graphs of all 20 layers (so launch gaps count as in the engine),
torch's ops against the kernels under each tile configuration asked for. Prints ms a step and the
ratio; the chosen defaults live in train/kernels/fused_norm.py.

    source benchmarks/gpu_setup.sh && python benchmarks/norm_kernels_gpu.py [--tiles 64,64,4,1024,8192,128,8 ...]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

# (channels, side, relu, residual) of ResNet18's 20 batch-norms, in the order they run
LAYERS = ([(64, 112, True, False)] + [(64, 56, True, False), (64, 56, True, True)] * 2
          + [t for c, s in ((128, 28), (256, 14), (512, 7)) for t in [(c, s, True, False), (c, s, False, False), (c, s, True, True),
                                                                       (c, s, True, False), (c, s, True, True)]])


def build(batch: int, dev: torch.device) -> list:
    """Each layer's input, residual, module, ReLU flag and output gradient."""
    xs = []
    for c, s, relu, res in LAYERS:
        x = torch.randn(batch, c, s, s, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last).requires_grad_()
        r = torch.randn_like(x).requires_grad_() if res else None
        bn = nn.BatchNorm2d(c).to(dev)
        g = torch.randn_like(x)
        xs.append((x, r, bn, relu, g))
    return xs


def step(layers: list, mine: bool) -> None:
    from mpsrun.train.kernels import fused_norm as fn

    for x, r, bn, relu, g in layers:
        if mine:
            y = fn._NormAct.apply(x, bn.weight, bn.bias, r, bn.running_mean, bn.running_var, 0.1, bn.eps, relu)
        else:
            y = bn(x)
            if r is not None:
                y = y + r
            if relu:
                y = torch.relu_(y)
        y.backward(g)


def timed(batch: int, mine: bool, dev: torch.device, reps: int = 20) -> float:
    layers = build(batch, dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step(layers, mine)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(layers, mine)
    for _ in range(3):
        graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tiles", nargs="*", default=[""], help="MPSRUN_NORM_TILES values to try ('' = the defaults)")
    args = ap.parse_args()
    import os

    from mpsrun.train.kernels import fused_norm as fn

    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    base = timed(args.batch, False, dev)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch}, bf16 channels_last, {len(LAYERS)} layers")
    print(f"| kernels | fwd+bwd ms a step | vs torch |\n| --- | ---: | ---: |\n| torch's batch-norm + add + ReLU | {base:.3f} | 1.00x |")
    for tiles in args.tiles:
        os.environ["MPSRUN_NORM_TILES"] = tiles
        fn._kernels.clear()
        t = timed(args.batch, True, dev)
        label = tiles or "defaults"
        print(f"| fused_norm ({label}) | {t:.3f} | {base / t:.2f}x |", flush=True)
    for c, s, relu, res in ((64, 112, True, False), (256, 14, True, True)):  # the check, as a run does it before capture
        fn.check((args.batch, c, s, s), torch.bfloat16, dev, 1e-5, relu, res)
    print("check: passed at the stem's and layer3's shapes")


if __name__ == "__main__":
    main()
