"""Where the data lives when `resident_max_gb` is `auto` (the default): what fits beside the model.

- CUDA: after one measured training step (undone), so the model, its gradients, the optimizer's
  state and the step's own peak are on the device already: the room is the free memory (the
  driver's, plus what torch's allocator holds unused), less the step's peak again (the CUDA graphs'
  private pool holds one) and the graphs' static input, and the data may take `SHARE` of that.
- MPS: `MPS_SHARE` of `torch.mps.recommended_max_memory()` less what the driver holds already (no
  step measured: MPS reports no peak, so half is left to the model, its optimizer and its steps).
- CPU: the data is in host memory already; it is gathered in the resident way (one shuffled copy
  per epoch) while that copy fits in a quarter of the available memory, else batch by batch.
A number in the recipe (`resident_max_gb: 4`) is the cap instead, as before.
Data over the room stays on the host and is fed to the device per batch (`host.HostBatches`).
"""

from __future__ import annotations

from typing import Optional

import torch

from mpsrun.plugins.builtin.images.memory import gib, host_available

SHARE = 0.8  # of the room measured on a GPU: fragmentation and the odd workspace take the rest
MPS_SHARE = 0.5  # of MPS's recommended working set: decided before the model and its step are there (MPS reports no peak)
CPU_SHARE = 0.25  # of the host's available memory the CPU path's per-epoch shuffled copy may take


def plan_time_room(device: torch.device, free_bytes: Optional[int]) -> tuple[Optional[int], str]:
    """The room decided before training (MPS, CPU, a data-parallel rank): bytes, and how; None: decide after a step (CUDA)."""
    if device.type == "mps":
        try:
            rec = int(torch.mps.recommended_max_memory())
            held = int(torch.mps.driver_allocated_memory())
        except Exception:
            rec, held = 0, 0
        if rec <= 0:
            return (free_bytes // 2 if free_bytes else 0), "half of the free memory MPS reports"
        return max(0, int(MPS_SHARE * rec) - held), f"{MPS_SHARE:.0%} of MPS's recommended working set {gib(rec)} less {gib(held)} in use"
    if device.type == "cpu":
        avail = host_available()
        if avail is None:
            return 2**62, "the data is in host memory already"
        return int(avail * CPU_SHARE), f"{CPU_SHARE:.0%} of the host's available {gib(avail)} (one shuffled copy per epoch)"
    return None, "after a measured step"


def cuda_room(device: torch.device, step_peak: int, static_bytes: int, graphs: bool) -> tuple[int, str]:
    """SHARE of what is free after the measured step, less a second step's peak (the graphs' pool) and their static input."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    extra = (step_peak + static_bytes) if graphs else 0
    room = max(0, int(SHARE * (free + cached - step_peak - extra)))
    how = (f"{SHARE:.0%} of {gib(free + cached)} free after the model, optimizer state and a measured step "
           f"(peak {gib(step_peak)}{f', again for the CUDA graphs with their {gib(static_bytes)} static input' if graphs else ''})")
    return room, how
