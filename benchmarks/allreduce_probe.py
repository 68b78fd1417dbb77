"""NCCL all-reduce time on this host's GPUs, at the sizes of resnet18's gradient buckets (issue 27, item 1).

Says whether the link between the ranks, not the step, is what the 2-GPU job waits for:
a bucket of resnet18's gradients is 16-28 MB in fp32. Eager collectives, timed with CUDA
events after warm-up; prints one line per size and dtype with the algorithm bandwidth.

    torchrun --nproc-per-node 2 benchmarks/allreduce_probe.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    for dtype in (torch.float32, torch.bfloat16):
        for mb in (1, 4, 16, 28, 47):
            n = mb * 2**20 // torch.tensor([], dtype=dtype).element_size()
            x = torch.ones(n, dtype=dtype, device="cuda")
            for _ in range(5):
                dist.all_reduce(x)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = 20
            a.record()
            for _ in range(reps):
                dist.all_reduce(x)
            b.record()
            torch.cuda.synchronize()
            ms = a.elapsed_time(b) / reps
            if rank == 0:
                print(f"all_reduce {mb:3d} MB {str(dtype).split('.')[-1]:9s} {ms * 1000:8.1f} us  algbw {mb * 2**20 / ms / 1e6:7.1f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
