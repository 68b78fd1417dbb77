"""Probe (device): where a fresh machine's first kernel checks spend their time. One mode per fresh process and cache."""
import os, sys, tempfile, time, threading
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
t0 = time.time()
import torch
dev = torch.device("cuda")
torch.zeros(1, device=dev)
print(f"  torch+cuda {time.time() - t0:.2f}", flush=True)
mode = sys.argv[1]
from mpsrun.train import warm
t = time.time(); warm.triton_key(); warm.wait_triton(); print(f"  key+utils {time.time() - t:.2f}", flush=True)
from mpsrun.train.kernels import fused_pool
from mpsrun.sweep.fused.kernels import convcheck, tconv, tsgd
bf = torch.bfloat16
GEO = (2, 2, 2, 0)
def pool(shape=(128, 512, 32, 32)):
    fused_pool.check(shape, bf, dev, GEO)
def shared():
    convcheck.check("shared", (128, 3, 32, 32), (1, 512, 3, 3, 3), bf, dev, (1, 1), (1, 1), (1, 1))
def grouped():
    convcheck.check("grouped", (128, 512, 16, 16), (16, 64, 32, 3, 3), bf, dev, (1, 1), (1, 1), (1, 1))
def timed(name, f):
    t = time.time(); f(); torch.cuda.synchronize(); print(f"  {name} {time.time() - t:.2f}", flush=True)
tconv._build(); tsgd._build(); fused_pool._build()
if mode == "pool-parts":
    x = torch.randn(128, 512, 32, 32, device=dev).to(bf).contiguous(memory_format=torch.channels_last)
    timed("pool fwd first call", lambda: fused_pool._forward(x, GEO, True))
    y, idx = fused_pool._forward(x, GEO, True)
    timed("pool bwd first call", lambda: fused_pool._backward(torch.ones_like(y), idx, x.shape, GEO))
    timed("pool check (compiled)", pool)
    timed("pool fwd no idx first call", lambda: fused_pool._forward(x, GEO, False))
elif mode == "pool":
    timed("pool check cold", pool)
    timed("pool check 2nd shape", lambda: pool((128, 1024, 16, 16)))
elif mode == "conv":
    timed("shared check cold", shared)
    timed("grouped check cold", grouped)
elif mode == "all":
    ths = [threading.Thread(target=timed, args=(n, f)) for n, f in (("pool", pool), ("shared", shared), ("grouped", grouped))]
    t = time.time(); [h.start() for h in ths]; [h.join() for h in ths]; print(f"  all three together {time.time() - t:.2f}")
