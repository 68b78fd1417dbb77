"""The module that a logged model holds: the trained network with the dataset's input transform in front.

Why a wrapper: datasets hand the runner raw tensors (uint8 images, packed table rows)
and a `transform` that scales them on the device. A model logged without that
transform would silently want different input than the data the run saw, and the
input example would lie. With it, `mlflow.pytorch.load_model(...)(raw_batch)` and
`mlflow.pyfunc` on the logged input example just work.

It lives in its own tiny module, importable by path with nothing but torch, because
MLflow pickles the module: unpickling in a fresh process imports this class by name.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn


class ServedModel(nn.Module):
    """`net(transform(x))`; `transform` may be None. Eval mode, on the CPU, when logged."""

    def __init__(self, net: nn.Module, transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        super().__init__()
        self.net = net
        self.transform = transform

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform is not None:
            x = self.transform(x)
        return self.net(x)

    def extra_repr(self) -> str:
        return f"transform={self.transform!r}"


def unwrap(model: Any) -> nn.Module:
    """The user's module under mpsrun's and torch's wrappers (torch.compile, DDP).

    A compiled module pickles its compiled graph code and a DDP module its process
    group; neither loads in another process, so only the plain module is logged.
    """
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(model, "module"):
            model = model.module
        else:
            break
    return model
