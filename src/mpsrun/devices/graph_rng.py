"""Random generators made usable again after a CUDA graph capture that failed.

Why: `torch.cuda.graph` registers the device's default generator (and any generator registered
with the graph) when the capture begins, marking its state as capturing, and unmarks it only once
`cudaStreamEndCapture` succeeds. A capture that broke (a host read inside it) leaves the state
marked, and the next random op outside a graph (dropout in the eager fallback, the next trial's run
in the same sweep worker) fails with "Offset increment outside graph capture encountered
unexpectedly". Each such generator gets a fresh state with the same seed and offset
(`graphsafe_set_state`): it draws next what it would have drawn.

Only for failure paths that drop every graph already captured: a graph captured before keeps the
old state, so its replays would no longer advance the generator the eager ops use.
"""

from __future__ import annotations

from typing import Iterable

import torch


def unstick(device: torch.device | None, generators: Iterable[torch.Generator] = ()) -> None:
    """No-op off CUDA (no capture there to have broken)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    for gen in [torch.cuda.default_generators[index], *generators]:
        if gen.device.type != "cuda":
            continue
        try:
            fresh = torch.Generator(device=gen.device)
            fresh.set_state(gen.get_state())
            gen.graphsafe_set_state(fresh)
        except Exception:  # noqa: BLE001 - an older torch without graphsafe_set_state: the op that needs it says so later
            pass
