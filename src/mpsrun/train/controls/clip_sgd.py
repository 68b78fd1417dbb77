"""SGD with the gradient clip folded into its own kernel: one launch per step where three were.

Why: in the CUDA-graphed step of a small model, kernels cost latency, not arithmetic.
FastClip (clipping.py) needs a norm kernel and a multiply before torch's fused SGD; the
fashion MLP's step went from 104 to 116 us with them (1.11x; the target is 1.10x).
Here one Triton kernel (clip_kernels.clip_sgd) adds the squares, waits grid-wide for
the norm, then applies torch's SGD rule to the clipped gradient as it reads it.

Same arithmetic as torch's clip followed by torch's SGD, up to float rounding and the
clip's 1e-6 epsilon; the gradients themselves stay unclipped (nothing reads them after
the step; the next step's zero_grad drops them). Used only where that is exact and
cheap: a FastClip is in use (CUDA, 2-norm, float32, one process, no fp16 scaler),
the optimizer is torch's SGD with one parameter group holding every trainable
parameter, at most 8 of them (one launch's slots), dampening 0 whenever there is
momentum, not differentiable. Everything else keeps FastClip + the optimizer.

The grid-wide wait assumes every program of the launch is resident at once, which one
program per SM gives on a GPU this process has to itself. `MPSRUN_CLIP_FOLD=0` turns the
fold off (for a GPU partitioned in ways the SM count does not show); the notes say so.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.optim.optimizer import Optimizer

from mpsrun.train.controls.clipping import SLOTS, FastClip, SGDState


def sm_count(device: torch.device) -> int:
    """The grid-wide wait needs every program resident at once: at most one per SM."""
    if device.type != "cuda":
        return 64
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


class ClipSGD(torch.optim.SGD):
    """torch's SGD whose step clips the gradients first, in the same kernel (see `fold`)."""

    _fold: tuple[Any, SGDState]  # (kernels, state): set by fold

    @torch.no_grad()
    def _clip_step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kernels, state = self._fold
        group = self.param_groups[0]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return loss
        bufs = None
        if group["momentum"]:
            bufs = []
            for p in params:
                st = self.state[p]
                if st.get("momentum_buffer") is None:  # dampening is 0: 0 * m + d = d, torch's first step
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                bufs.append(st["momentum_buffer"])
        kernels.clip_sgd(state, params, bufs, group)
        return loss

    step = Optimizer.profile_hook_step(_clip_step)  # step hooks run, as for torch's own optimizers
    step.hooked = True  # type: ignore[attr-defined]  # Optimizer._patch_step_function: already wrapped


def why_not(optimizer: torch.optim.Optimizer, clipper: FastClip | None) -> str | None:
    """Why the clip cannot fold into this optimizer's step, or None when it can."""
    from mpsrun.train.controls.schedulers import TensorLRSGD

    if clipper is None:
        return "the clip runs through torch's clip_grad_norm_"
    if os.environ.get("MPSRUN_CLIP_FOLD", "1") == "0":
        return "MPSRUN_CLIP_FOLD=0"  # an escape hatch: a GPU shared so that one program per SM is not resident
    if type(optimizer) not in (torch.optim.SGD, TensorLRSGD):
        return f"{type(optimizer).__name__} is not torch's SGD"
    if len(optimizer.param_groups) != 1:
        return "more than one parameter group"
    group = optimizer.param_groups[0]
    if {id(p) for p in group["params"] if p.requires_grad} != {id(p) for p in clipper.params}:  # frozen ones never step
        return "the optimizer does not hold exactly the clipped parameters"
    if len(clipper.params) > SLOTS:
        return f"{len(clipper.params)} parameter tensors (one launch takes {SLOTS})"
    if group["momentum"] and group["dampening"]:
        return "momentum with dampening"
    if group.get("differentiable"):
        return "a differentiable optimizer"
    return None


def fold(optimizer: torch.optim.Optimizer, clipper: FastClip) -> str | None:
    """Make `optimizer` a ClipSGD that clips with `clipper`'s norm state; None when done, else why not.

    Call before a scheduler wraps `optimizer.step` (it binds the class's step then).
    """
    why = why_not(optimizer, clipper)
    if why is not None:
        return why
    device = clipper.peak.device
    optimizer.__class__ = ClipSGD
    optimizer._fold = (clipper.kernels, SGDState(clipper.max_norm, clipper.peak, sm_count(device)))  # type: ignore[attr-defined]
    clipper.folded = True
    return None
