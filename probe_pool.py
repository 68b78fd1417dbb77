"""Probe (device): each step of fused_pool's check, timed, on a fresh process (kernels compiled first)."""
import os, tempfile, time
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
import torch
from torch import nn
from mpsrun.train.kernels import fused_pool as fp
dev = torch.device("cuda"); bf = torch.bfloat16; geo = (2, 2, 2, 0); shape = (128, 512, 32, 32)
torch.zeros(1, device=dev)
def T(name, f):
    torch.cuda.synchronize(); t = time.time(); r = f(); torch.cuda.synchronize(); print(f"  {name} {time.time() - t:.3f}", flush=True); return r
x0 = torch.randn(shape, device=dev).to(bf).contiguous(memory_format=torch.channels_last)
y, idx = T("triton fwd compile", lambda: fp._forward(x0, geo, True))
T("triton bwd compile", lambda: fp._backward(torch.ones_like(y), idx, x0.shape, geo))
for rep in range(2):
    print(f" rep {rep}")
    gen = T("generator", lambda: torch.Generator(device=dev).manual_seed(0))
    x = T("randint", lambda: torch.randint(-3, 4, shape, device=dev, generator=gen).to(bf))
    T("nan set", lambda: x.view(-1).__setitem__(slice(None, None, max(1, x.numel() // 7)), float("nan")))
    x = T("channels_last", lambda: x.contiguous(memory_format=torch.channels_last).requires_grad_())
    with torch.enable_grad():
        got = T("triton apply", lambda: fp._MaxPool.apply(x, geo))
        want = T("torch max_pool2d", lambda: nn.functional.max_pool2d(x, (2, 2), 2, 0))
        g = T("g", lambda: torch.randint(-8, 9, got.shape, device=dev, generator=gen).to(bf) / 4)
        (mine,) = T("triton grad", lambda: torch.autograd.grad(got, x, g))
        (ref,) = T("torch grad", lambda: torch.autograd.grad(want, x, g))
    T("compare", lambda: torch.equal(torch.nan_to_num(mine, nan=1e4), torch.nan_to_num(ref, nan=1e4)))
