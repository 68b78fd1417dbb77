"""What the kernels share: which modules they must leave alone, and swapping a module's forward for a block.

Why a swap and not a new model: evaluation outside the graphs, export and checkpoints must see
the user's modules as they are, so a kernel stands in for a module only while GraphTrainer warms
up and captures (the replays then run it without Python), as an instance attribute deleted after.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from torch import nn


def hooked(m: nn.Module) -> bool:
    """Whether `m` has module hooks, which a kernel standing in for its forward would skip."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None))


@contextlib.contextmanager
def swapped(forwards: list[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Each module's forward is its callable inside the block; its class's own again after, whatever happens."""
    for m, forward in forwards:
        m.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m, _ in forwards:
            m.__dict__.pop("forward", None)
