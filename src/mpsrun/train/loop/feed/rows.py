"""Rows of a host tensor (in RAM or a memory map), gathered batch by batch in the resident path's order.

`host.HostBatches` gathers from here (or from a disk stream, `stream.DiskRows`) on its thread; `take_rows`
is the gather itself, numpy's `take` on the calling thread, and `populate` maps a memory map's pages at
once before the first epoch gathers from it.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import numpy as np
import torch


class MemoryRows:
    """Rows of a host tensor (in RAM or a memory map), gathered in the resident path's order."""

    path_name = "host slices"

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.n = len(y)
        self.sample_shape = tuple(x.shape[1:])
        self.bytes = x.numel() * x.element_size() + y.numel() * y.element_size()
        self.mapped = False  # the rows' pages are in this process's page tables (`populate`)

    def begin(self, generator: Optional[torch.Generator], shuffle: bool) -> "MemoryEpoch":
        if not self.mapped:
            self.mapped = True
            populate(self.x)
        return MemoryEpoch(self, torch.randperm(self.n, generator=generator) if shuffle else None)

    def head(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[:k], self.y[:k]


class MemoryEpoch:
    def __init__(self, src: MemoryRows, perm: Optional[torch.Tensor]) -> None:
        self.src, self.perm = src, perm

    def fill(self, out_x: torch.Tensor, out_y: torch.Tensor, a: int, b: int) -> None:
        if self.perm is None:
            out_x[: b - a].copy_(self.src.x[a:b])
            out_y[: b - a].copy_(self.src.y[a:b])
            return
        idx = self.perm[a:b]
        take_rows(self.src.x, idx, out_x[: b - a])
        take_rows(self.src.y, idx, out_y[: b - a])

    def rows(self, a: int, b: int) -> torch.Tensor:
        """The source rows of positions [a, b) of the epoch."""
        return torch.arange(a, b) if self.perm is None else self.perm[a:b]

    def close(self) -> None:
        pass


MADV_POPULATE_READ = 22  # Linux 5.14+: map a range's pages now, as reads would fault them in


def populate(x: torch.Tensor) -> bool:
    """Map every page of `x` into this process at once (madvise MADV_POPULATE_READ); True if the kernel did.

    Why: a cache reopened by a later run is a fresh memory map, and its first epoch faulted every page in
    while gathering: on the 2-core machine 6,000 images of 256 px (1.2 GB, page cache warm) gathered at
    2.0 GB/s the first time and 7-8 GB/s after; populated first (0.03 s), the first gather ran at 5.4 GB/s.
    Memory in RAM already mapped is left as it is; where the call is missing (another OS, an older kernel)
    the pages are faulted in by the gather as before.
    """
    if not sys.platform.startswith("linux") or x.device.type != "cpu" or x.numel() == 0 or not x.is_contiguous():
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = os.sysconf("SC_PAGE_SIZE")
        addr = x.data_ptr()
        start = addr - addr % page
        return libc.madvise(start, addr - start + x.numel() * x.element_size(), MADV_POPULATE_READ) == 0
    except (OSError, AttributeError, ValueError):
        return False


def take_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """out[:] = src[idx] along the first dimension, on the calling thread only.

    Why numpy's `take` and not `torch.index_select`: torch splits the copy over its intra-op (OpenMP) threads, and
    called from a feeding thread that makes a team of its own per calling thread beside the training's: on the
    2-core machine under load, 128 rows of 196 KB went from 9,400 rows/s (one torch thread) to 340 (two). numpy
    copies row by row (a memmove of each row) with the GIL released; `HostBatches` splits a batch over its own pool.
    """
    if src.dtype in _NOT_NUMPY:  # bfloat16 and the like: torch's own copy
        torch.index_select(src, 0, idx, out=out)
        return
    np.take(src.numpy(), idx.numpy(), axis=0, out=out.numpy(), mode="clip")  # "raise" would copy through a buffer of out's size


_NOT_NUMPY = {torch.bfloat16, getattr(torch, "float8_e4m3fn", torch.bfloat16), getattr(torch, "float8_e5m2", torch.bfloat16)}


def pinned_alias(x: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(a pinned copy of x, a CUDA tensor over that same host memory): kernels given the second read host memory
    over PCIe (unified addressing), so a batch is gathered by one index_select on the GPU and no CPU thread copies it.

    Why through `__cuda_array_interface__`: torch has no call that views pinned host memory as a CUDA tensor; it asks
    the driver where a foreign pointer lives (pinned memory: the GPU that mapped it) and wraps it without a copy. The
    pinned copy must outlive the view (the caller keeps both).
    """
    np_dtype = torch.empty((), dtype=x.dtype).numpy().dtype  # bfloat16 and the like: TypeError, no zero-copy
    pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    pinned.copy_(x)

    class _Pointer:  # the pinned memory as the GPU addresses it
        __cuda_array_interface__ = {"shape": tuple(x.shape), "typestr": np_dtype.str, "data": (pinned.data_ptr(), False), "version": 3,
                                    "strides": None}

    alias = torch.as_tensor(_Pointer(), device=device)
    if not alias.is_cuda or alias.data_ptr() != pinned.data_ptr():
        raise RuntimeError("the pinned copy is not addressable from the GPU (no unified addressing)")
    return pinned, alias
