"""Where `mpsrun parity`'s tolerances come from, measured on the shipped recipes (CPU only).

For each recipe and precision this runs parity on the CPU with three kinds of
device B, and prints per quantity the largest relative difference ||B-A||/||A||,
the precision's own noise (the yardstick replica: fp64 for fp32, fp32 for bf16),
and the worst difference/tolerance ratio (above 1: "diverge"):

- `reordered`: a stand-in for another *correct* device: the same batch in another
  sample order, so every reduction over the batch adds its terms in another
  order, as another device's kernels do. Must agree.
- `lost update`: a stand-in for the MPS bug where an optimizer's in-place update
  through a non-contiguous view was lost: B's first weight tensor never moves.
  Must diverge.
- `logits x1.01`: B's model output off by 1% (a subtly wrong kernel). Must diverge.

    python benchmarks/parity_calibrate.py [--steps 20,200] [--fashion-root DIR]

Without --fashion-root a small synthetic FashionMNIST is written to a temp folder.
The numbers quoted in mpsrun/devices/parity/run.py's docstring come from this script.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from mpsrun.devices.parity import run as parity
from mpsrun.plugins import resolve

ROOT = Path(__file__).resolve().parents[1]


class Reordered(parity.Replica):
    """Another correct device: per-sample results unchanged, batch reductions reordered."""

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(int(y.sum()) + len(y)))
        return super().step(x[perm], y[perm])


class LostUpdate(parity.Replica):
    """A broken device: the optimizer's update of the first weight tensor is lost."""

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        p = next(self.model.parameters())
        before = p.detach().clone()
        out = super().step(x, y)
        with torch.no_grad():
            p.copy_(before)
        return out


class Scaled(parity.Replica):
    """A subtly wrong device: every model output 1% too large."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.model.register_forward_hook(lambda module, inputs, out: out * 1.01)


KINDS = {"reordered": Reordered, "lost update": LostUpdate, "logits x1.01": Scaled}


def measure(recipe: Path, overrides: list[str], precision: str, steps: int, kind: str) -> parity.ParityResult:
    resolved = resolve(recipe, [*overrides, f"precision={precision}"])
    prep = parity.prepare(resolved, ("cpu", "cpu"), steps)
    cpu = torch.device("cpu")
    args = (prep.model, cpu, resolved, precision, False, prep.splits.transform)
    reps = (parity.Replica(*args), KINDS[kind](*args))
    return parity.execute(prep, reps=reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="20,200", help="comma-separated step counts")
    ap.add_argument("--fashion-root", default=None, help="folder holding FashionMNIST/raw (default: synthetic, temp)")
    a = ap.parse_args()
    marks = sorted(int(s) for s in a.steps.split(","))
    root = a.fashion_root
    if root is None:
        from mpsrun.testing.idx import write_idx_dataset

        root = tempfile.mkdtemp(prefix="fm-")
        write_idx_dataset(root, "FashionMNIST", n_train=4096, n_test=256, seed=0)
    recipes = [
        ("digits_mlp (adam)", ROOT / "recipes" / "digits_mlp.yaml", ["device=cpu"]),
        ("fashion_mlp (sgd)", ROOT / "recipes" / "fashion_mlp_mps.yaml", ["device=cpu", f"dataset.root={root}", "dataset.download=false"]),
    ]
    qs = ("loss", "grad_norm", "logits", "params")
    print(f"{'recipe':<18} {'prec':<5} {'steps':>5} {'device B':<13} " + " ".join(f"{q + ' rel/noise':>19}" for q in qs) + f" {'worst/tol':>9}  verdict")
    for label, path, ov in recipes:
        for precision in ("fp32", "bf16"):
            for steps in marks:
                for kind in KINDS:
                    if kind != "reordered" and steps != marks[0]:
                        continue
                    res = measure(path, ov, precision, steps, kind)
                    s = res.summary()
                    cells = " ".join(f"{s[q].max_rel:>9.1e}/{s[q].max_noise:<9.1e}" for q in qs)
                    worst = max(s[q].max_ratio for q in qs)
                    print(f"{label:<18} {precision:<5} {steps:>5} {kind:<13} {cells} {worst:>9.2g}  {res.verdict} ({res.divergence_text()})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
