"""Probe (retired after one use): the fused 16-member small CNN step in several formulations, graphed, on CUDA (`python THIS [M]`)."""
import sys
import time

import torch
import torch.nn.functional as F

torch.backends.cudnn.benchmark = True
dev = torch.device("cuda")
M, B = int(sys.argv[1]) if len(sys.argv) > 1 else 16, 128
C1, C2, H = 32, 64, 32
HID = 128
g = torch.Generator(device=dev).manual_seed(0)


def rnd(*s):
    return (torch.randn(*s, device=dev, generator=g) * 0.05).requires_grad_()


w1, b1 = rnd(M, C1, 3, 3, 3), rnd(M, C1)
w2, b2 = rnd(M, C2, C1, 3, 3), rnd(M, C2)
l1, lb1 = rnd(M, HID, C2 * 64), rnd(M, HID)
l2, lb2 = rnd(M, 10, HID), rnd(M, 10)
PARAMS = [w1, b1, w2, b2, l1, lb1, l2, lb2]
X = torch.randn(B, 3, H, H, device=dev)
Y = torch.randint(0, 10, (B,), device=dev)
Xcl = X.contiguous(memory_format=torch.channels_last)

pool_fn = lambda t: F.max_pool2d(t, 2)  # noqa: E731
try:
    from torch import nn

    from mpsrun.train.kernels import fused_pool

    mp = nn.MaxPool2d(2)
    geo = fused_pool._geometry(mp)

    def fpool(t):
        return fused_pool.max_pool(t, mp, geo)
except Exception as e:  # noqa: BLE001
    print("no fused pool", e)
    fpool = pool_fn


def head(y):  # y packed [B, M*C2, 8, 8] -> loss
    z = y.reshape(B, M, C2, 8, 8).transpose(0, 1).reshape(M, B, -1)
    h = torch.relu(torch.baddbmm(lb1.unsqueeze(1), z, l1.transpose(1, 2)))
    o = torch.baddbmm(lb2.unsqueeze(1), h, l2.transpose(1, 2))
    return F.cross_entropy(o.reshape(M * B, 10), Y.repeat(M), reduction="sum")


def conv1_grouped(x, cl):
    xin = x.unsqueeze(1).expand(B, M, 3, H, H).reshape(B, M * 3, H, H)
    if cl:
        xin = xin.contiguous(memory_format=torch.channels_last)
    return F.conv2d(xin, w1.reshape(M * C1, 3, 3, 3), b1.reshape(-1), padding=1, groups=M)


def conv1_dense(x, cl):
    return F.conv2d(x, w1.reshape(M * C1, 3, 3, 3), b1.reshape(-1), padding=1)


def conv1_gemm(x, cl):
    cols = F.unfold(x, 3, padding=1).transpose(1, 2).reshape(B * H * H, 27)
    cols = torch.cat([cols, torch.ones(B * H * H, 1, device=x.device)], 1)
    w = torch.cat([w1.reshape(M * C1, 27), b1.reshape(M * C1, 1)], 1)
    return (cols @ w.t()).view(B, H, H, M * C1).permute(0, 3, 1, 2)


def conv2_grouped(y):
    return F.conv2d(y, w2.reshape(M * C2, C1, 3, 3), b2.reshape(-1), padding=1, groups=M)


def conv2_loop(y):  # y packed [B, M*C1, 16, 16]
    ys = []
    for j in range(M):
        ys.append(F.conv2d(y[:, j * C1:(j + 1) * C1], w2[j], b2[j], padding=1))
    return torch.cat(ys, 1)


def conv2_loop_mm(y):  # member-major copy first
    cl = y.is_contiguous(memory_format=torch.channels_last)
    z = y.reshape(B, M, C1, 16, 16).transpose(0, 1)
    ys = []
    for j in range(M):
        zj = z[j].contiguous(memory_format=torch.channels_last) if cl else z[j].contiguous()
        ys.append(F.conv2d(zj, w2[j], b2[j], padding=1))
    return torch.cat(ys, 1)


def conv2_unfold(y):
    cols = F.unfold(y, 3, padding=1)  # [B, M*C1*9, 256]
    cols = cols.reshape(B, M, C1 * 9, 256).permute(1, 0, 3, 2).reshape(M, B * 256, C1 * 9)
    out = torch.baddbmm(b2.unsqueeze(1), cols, w2.reshape(M, C2, C1 * 9).transpose(1, 2))  # [M, B*256, C2]
    return out.reshape(M, B, 16, 16, C2).permute(1, 0, 4, 2, 3).reshape(B, M * C2, 16, 16)


def make(conv1, conv2, cl, pool, dtype=None, after=False):
    def step():
        x = Xcl if cl else X
        with torch.autocast("cuda", dtype=dtype) if dtype else torch.autocast("cuda", enabled=False):
            y = torch.relu(pool(conv1(x, cl))) if after else pool(torch.relu(conv1(x, cl)))
            if cl:
                y = y.contiguous(memory_format=torch.channels_last)
            y = torch.relu(pool(conv2(y))) if after else pool(torch.relu(conv2(y)))
            loss = head(y)
        return torch.autograd.grad(loss, PARAMS)
    return step


def solo_step():
    from torch import nn
    if not hasattr(solo_step, "m"):
        solo_step.m = nn.Sequential(nn.Conv2d(3, C1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(C1, C2, 3, padding=1), nn.ReLU(),
                                    nn.MaxPool2d(2), nn.Flatten(), nn.Linear(C2 * 64, HID), nn.ReLU(), nn.Linear(HID, 10)).to(dev).to(memory_format=torch.channels_last)
    m = solo_step.m
    loss = F.cross_entropy(m(Xcl), Y, reduction="sum")
    return torch.autograd.grad(loss, list(m.parameters()))


def timed(name, step, reps=100):
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            step()
        gr.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            gr.replay()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / reps * 1e3
        print(f"{name:40s} {ms:7.3f} ms/step", flush=True)
        return ms
    except Exception as e:  # noqa: BLE001
        print(f"{name:40s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.synchronize()
        return None


# correctness of the alternatives against grouped (same params)
with torch.no_grad():
    ref = conv2_grouped(torch.randn(B, M * C1, 16, 16, device=dev))
    yy = torch.randn(B, M * C1, 16, 16, device=dev)
    a, b_, c = conv2_grouped(yy), conv2_unfold(yy), conv2_loop(yy)
    print("unfold vs grouped max diff", (a - b_).abs().max().item(), "loop", (a - c).abs().max().item())
    print("dense1 vs grouped1", (conv1_dense(X, False) - conv1_grouped(X, False)).abs().max().item())
    print("gemm1 vs dense1", (conv1_dense(X, False) - conv1_gemm(X, False)).abs().max().item())

print(f"M={M} B={B} torch {torch.__version__} {torch.cuda.get_device_name()}")
solo = timed("solo (1 member, torch pool, NHWC)", solo_step)
rows = [
    ("dense1+grouped2 NHWC fusedpool relu-after", make(conv1_dense, conv2_grouped, True, fpool, after=True)),
    ("gemm1+grouped2 NHWC fusedpool relu-after", make(conv1_gemm, conv2_grouped, True, fpool, after=True)),
    ("gemm1+grouped2 NHWC fusedpool", make(conv1_gemm, conv2_grouped, True, fpool)),
    ("gemm1+grouped2 NCHW2 fusedpool relu-after", make(conv1_gemm, lambda y: conv2_grouped(y.contiguous()).contiguous(memory_format=torch.channels_last), True, fpool, after=True)),
    ("grouped1+grouped2 NHWC (now)", make(conv1_grouped, conv2_grouped, True, pool_fn)),
    ("grouped1+grouped2 NCHW", make(conv1_grouped, conv2_grouped, False, pool_fn)),
    ("dense1+grouped2 NHWC", make(conv1_dense, conv2_grouped, True, pool_fn)),
    ("dense1+grouped2 NCHW", make(conv1_dense, conv2_grouped, False, pool_fn)),
    ("dense1+grouped2 NHWC fusedpool", make(conv1_dense, conv2_grouped, True, fpool)),
    ("dense1+grouped2 NHWC bf16 fusedpool", make(conv1_dense, conv2_grouped, True, fpool, torch.bfloat16)),
    ("grouped1+grouped2 NHWC bf16", make(conv1_grouped, conv2_grouped, True, pool_fn, torch.bfloat16)),
]
best = None
for name, st in rows:
    ms = timed(name, st)
    if ms and solo:
        print(f"{'':40s} {solo * M / ms:5.2f}x the solo step's throughput", flush=True)
    if ms and (best is None or ms < best[0]):
        best = (ms, name, st)
if best:
    from torch.profiler import ProfilerActivity, profile
    for name, st in rows:
        if name == best[1] or name.startswith("gemm1+grouped2 NHWC fusedpool relu"):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    st()
                torch.cuda.synchronize()
            print(f"--- profile: {name} (eager, 20 steps)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
