"""Where `mpsrun parity`'s tolerances and noise caps come from, measured on the shipped recipes.

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
        [--device cpu|cuda] [--precisions fp32,bf16,fp16] [--markdown FILE]

`--device cuda` puts A and B on the GPU (its real fp16/bf16 kernels; the yardstick
stays on the CPU), which is how fp16's noise caps are calibrated; each row also
prints the largest noise as a share of its cap (`NOISE_CAPS`, devices/parity/
tolerance.py): a correct device must stay below 1 there, or parity would call A
suspect. `--markdown` also writes the table as Markdown (for docs/benchmarks.md).
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


def measure(recipe: Path, overrides: list[str], precision: str, steps: int, kind: str, device: str = "cpu") -> parity.ParityResult:
    resolved = resolve(recipe, [*overrides, f"precision={precision}"])
    prep = parity.prepare(resolved, (device, device), steps)
    dev = torch.device(device)
    args = (prep.model, dev, resolved, precision, False, prep.splits.transform)
    reps = (parity.Replica(*args), KINDS[kind](*args))
    return parity.execute(prep, reps=reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="20,200", help="comma-separated step counts")
    ap.add_argument("--fashion-root", default=None, help="folder holding FashionMNIST/raw (default: synthetic, temp)")
    ap.add_argument("--device", default="cpu", help="device of A and B (the yardstick stays on the CPU): cpu or cuda")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    ap.add_argument("--markdown", default=None, help="also write the table as Markdown to this file")
    a = ap.parse_args()
    precisions = [p.strip() for p in a.precisions.split(",") if p.strip()]
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
    import platform

    from mpsrun.devices.parity.tolerance import NOISE_CAPS

    where = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else (platform.processor() or platform.machine())
    print(f"# A and B on {a.device} ({where}), torch {torch.__version__}; yardstick on the CPU")
    print(f"{'recipe':<18} {'prec':<5} {'steps':>5} {'device B':<13} " + " ".join(f"{q + ' rel/noise':>19}" for q in qs) + f" {'noise/cap':>9} {'worst/tol':>9}  verdict")
    md = [
        f"A and B on `{a.device}` ({where}), torch {torch.__version__}; yardstick on the CPU. Per quantity: max rel diff / max noise.",
        "",
        "| recipe | precision | steps | device B | " + " | ".join(qs) + " | noise / cap | worst / tol | verdict |",
        "| --- | --- | ---: | --- | " + " | ".join("---" for _ in qs) + " | ---: | ---: | --- |",
    ]
    for label, path, ov in recipes:
        for precision in precisions:
            caps = NOISE_CAPS[precision]
            for steps in marks:
                for kind in KINDS:
                    if kind != "reordered" and steps != marks[0]:
                        continue
                    res = measure(path, ov, precision, steps, kind, a.device)
                    s = res.summary()
                    cells = " ".join(f"{s[q].max_rel:>9.1e}/{s[q].max_noise:<9.1e}" for q in qs)
                    worst = max(s[q].max_ratio for q in qs)
                    of_cap = max(s[q].max_noise / caps[q] for q in qs)
                    print(
                        f"{label:<18} {precision:<5} {steps:>5} {kind:<13} {cells} {of_cap:>9.2g} {worst:>9.2g}  {res.verdict} ({res.divergence_text()})",
                        flush=True,
                    )
                    md.append(
                        f"| {label} | {precision} | {steps} | {kind} | "
                        + " | ".join(f"{s[q].max_rel:.1e} / {s[q].max_noise:.1e}" for q in qs)
                        + f" | {of_cap:.2g} | {worst:.2g} | {res.verdict} ({res.divergence_text()}) |"
                    )
    if a.markdown:
        Path(a.markdown).write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
