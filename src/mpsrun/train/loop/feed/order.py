"""Each epoch's sample order: a pure function of (seed, epoch), full or in shuffled blocks.

Full: `torch.randperm(n)` from a CPU generator seeded by `epoch_seed`, the draw the resident path
makes, so data gathered on the host trains on exactly the batches resident data would.

Blocks (data streamed from disk): a full permutation would read the disk in random 100-KB pieces;
instead the rows are cut into blocks of consecutive rows, the blocks are permuted, and the rows of
each window of consecutive (permuted) blocks are shuffled together. Every row comes once an epoch and
every block is read once, front to back; how well it mixes is the window's size (the memory budget).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of one epoch: a pure function of (seed, epoch).

    So an epoch's data order does not depend on how many epochs ran before it in
    this process, and a run resumed from a checkpoint sees exactly the batches an
    uninterrupted run would have seen.
    """
    return (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) % 2**63


@dataclass
class BlockOrder:
    """One epoch of a block-shuffled order over `n` rows.

    windows: per window, the blocks it holds (block b covers rows [b * block_rows, (b + 1) * block_rows)).
    local: per window, a permutation of its rows' positions in the window's buffer (blocks laid out
    in the window's order), i.e. which buffered row each successive sample is.
    """

    n: int
    block_rows: int
    windows: list[list[int]]
    local: list[torch.Tensor]

    def block_range(self, b: int) -> tuple[int, int]:
        return b * self.block_rows, min(self.n, (b + 1) * self.block_rows)

    def rows(self, w: int) -> torch.Tensor:
        """The rows (0..n-1) of window `w` in the order they are served."""
        buf = torch.cat([torch.arange(*self.block_range(b)) for b in self.windows[w]])
        return buf[self.local[w]]

    def all_rows(self) -> torch.Tensor:
        return torch.cat([self.rows(w) for w in range(len(self.windows))]) if self.windows else torch.zeros(0, dtype=torch.long)


def block_order(n: int, block_rows: int, window_blocks: int, generator: torch.Generator | None, shuffle: bool = True) -> BlockOrder:
    """Blocks permuted, then rows shuffled within each window of `window_blocks` blocks (no shuffle: in file order)."""
    block_rows = max(1, int(block_rows))
    nb = -(-n // block_rows)
    blocks = torch.randperm(nb, generator=generator).tolist() if shuffle else list(range(nb))
    step = max(1, int(window_blocks))
    windows = [blocks[i : i + step] for i in range(0, nb, step)]
    local = []
    for w in windows:
        m = sum(min(n, (b + 1) * block_rows) - b * block_rows for b in w)
        local.append(torch.randperm(m, generator=generator) if shuffle else torch.arange(m))
    return BlockOrder(n, block_rows, windows, local)
