"""Probe (retired after one use): the grouped 3x3 convolution of 16 members alone (forward + backward) in several formulations, on CUDA."""
import sys, time
import torch
import torch.nn.functional as F
torch.backends.cudnn.benchmark = True
dev = torch.device("cuda")
M, B, C1, C2, S = 16, 128, 32, 64, 16
g = torch.Generator(device=dev).manual_seed(0)
w2 = (torch.randn(M, C2, C1, 3, 3, device=dev, generator=g) * 0.05).requires_grad_()
b2 = torch.zeros(M, C2, device=dev).requires_grad_()
ynchw = torch.randn(B, M * C1, S, S, device=dev, generator=g).requires_grad_()
ynhwc = ynchw.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
ymm = ynchw.detach().reshape(B, M, C1, S, S).transpose(0, 1).contiguous().requires_grad_()  # [M,B,C1,S,S] NCHW per member
ymmcl = torch.stack([ymm[j].detach().contiguous(memory_format=torch.channels_last) for j in range(M)]).requires_grad_()  # stack keeps? check
R = torch.randn(B, M * C2, S, S, device=dev)

def grouped(y):
    def f():
        o = F.conv2d(y, w2.reshape(M * C2, C1, 3, 3), b2.reshape(-1), padding=1, groups=M)
        return torch.autograd.grad((o * R).sum(), [y, w2, b2])
    return f

def grouped_via_nchw(y):  # NHWC in, NCHW conv, NHWC out
    def f():
        o = F.conv2d(y.contiguous(), w2.reshape(M * C2, C1, 3, 3), b2.reshape(-1), padding=1, groups=M)
        o = o.contiguous(memory_format=torch.channels_last)
        return torch.autograd.grad((o * R).sum(), [y, w2, b2])
    return f

def bf16(y):
    def f():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            o = F.conv2d(y, w2.reshape(M * C2, C1, 3, 3), b2.reshape(-1), padding=1, groups=M)
        return torch.autograd.grad((o.float() * R).sum(), [y, w2, b2])
    return f

def loop(y, cl, nstreams=0):
    streams = [torch.cuda.Stream() for _ in range(nstreams)]
    Rm = R.reshape(B, M, C2, S, S).transpose(0, 1).contiguous()
    def f():
        main = torch.cuda.current_stream()
        tot = []
        for j in range(M):
            if streams:
                s = streams[j % nstreams]
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    xj = y[j].contiguous(memory_format=torch.channels_last) if cl else y[j]
                    o = F.conv2d(xj, w2[j], b2[j], padding=1)
                    tot.append((o * Rm[j]).sum())
            else:
                xj = y[j].contiguous(memory_format=torch.channels_last) if cl else y[j]
                o = F.conv2d(xj, w2[j], b2[j], padding=1)
                tot.append((o * Rm[j]).sum())
        for s in streams:
            main.wait_stream(s)
        return torch.autograd.grad(torch.stack(tot).sum(), [y, w2, b2])
    return f

def timed(name, step, reps=100):
    try:
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3): step()
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr): step()
        gr.replay(); torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps): gr.replay()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / reps * 1e3
        print(f"{name:44s} {ms:7.3f} ms", flush=True)
    except Exception as e:
        print(f"{name:44s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.synchronize()

def prof(name, step):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(10): step()
        torch.cuda.synchronize()
    print(f"--- {name}")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=90))

# solo conv2 (one member) for scale
xs = torch.randn(B, C1, S, S, device=dev).contiguous(memory_format=torch.channels_last).requires_grad_()
ws = w2[0].detach().clone().requires_grad_(); bs = torch.zeros(C2, device=dev).requires_grad_()
Rs = torch.randn(B, C2, S, S, device=dev)
timed("solo conv2 one member NHWC", lambda: torch.autograd.grad((F.conv2d(xs, ws, bs, padding=1) * Rs).sum(), [xs, ws, bs]))
timed("grouped NHWC", grouped(ynhwc))
timed("grouped NCHW", grouped(ynchw))
timed("grouped NHWC->NCHW->NHWC", grouped_via_nchw(ynhwc))
timed("grouped NHWC bf16", bf16(ynhwc))
timed("loop member-major NCHW", loop(ymm, False))
timed("loop member-major NHWC", loop(ymm, True))
for n in (4, 8, 16):
    timed(f"loop member-major NHWC {n} streams", loop(ymm, True, n))
    timed(f"loop member-major NCHW {n} streams", loop(ymm, False, n))
torch.backends.cudnn.benchmark = False
timed("grouped NHWC, cudnn.benchmark off", grouped(ynhwc))
timed("grouped NCHW, cudnn.benchmark off", grouped(ynchw))
torch.backends.cudnn.benchmark = True
prof("grouped NHWC", grouped(ynhwc))
prof("grouped NCHW", grouped(ynchw))
