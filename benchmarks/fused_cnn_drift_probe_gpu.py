"""Probe (retired after one use): which part of the packed CNN path moves members from their solo runs (CUDA, fp32; run from the project root)."""
import sys, tempfile
from pathlib import Path
sys.path.insert(0, ".")
import torch
import torch.nn.functional as F
from tests.test_fused_graphs import _members, _against_solo, CNN_BASE, SGD
from tests.test_sweep_fused import _worst
from mpsrun.sweep.fused import graphed, members, layers
torch.backends.cudnn.allow_tf32 = False
gentle = [{"optimizer.lr": 0.02, "optimizer.momentum": 0.9}, {**SGD[1], "optimizer.lr": 0.02}]

class OldConv:
    @staticmethod
    def apply(x, w, b, stride, padding, dilation):
        return F.conv2d(x, w.reshape(-1, *w.shape[2:]), b.reshape(-1) if b is not None else None, stride, padding, dilation, groups=w.shape[0])

def run(label, variants, conv=None, swap=True, pools=True):
    tmp = Path(tempfile.mkdtemp())
    real = (layers._GroupedConv, layers.Stacked.order, layers.FastPools.why_not)
    if conv: layers._GroupedConv = conv
    if not swap: layers.Stacked.order = lambda self: list(range(len(self.layers)))
    if not pools: layers.FastPools.why_not = staticmethod(lambda *a: "off")
    try:
        mems, recs = _members(tmp, "sgd", variants, "cuda", "cnn", CNN_BASE)
        b = members.build(mems, {}); g, _ = graphed.group_for(b, print); g.run(lambda m, e, x: None)
    finally:
        layers._GroupedConv, layers.Stacked.order, layers.FastPools.why_not = real
    pairs = _against_solo(mems, recs)
    print(f"{label:40s} worst {_worst(pairs):.2e}", [(round(a, 6), round(b, 6)) for a, b in pairs], flush=True)

for name, v in (("SGD[:2]", SGD[:2]), ("gentle", gentle)):
    run(f"{name} new", v)
    run(f"{name} old grouped conv backward", v, conv=OldConv)
    run(f"{name} no relu swap", v, swap=False)
    run(f"{name} no fast pools", v, pools=False)
    run(f"{name} all old", v, conv=OldConv, swap=False, pools=False)
