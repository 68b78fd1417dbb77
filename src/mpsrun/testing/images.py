"""Write a small folder of labelled images, to try `image_folder` / `image_csv` offline and in tests.

    python -m mpsrun.testing.images data/shapes                 # data/shapes/<class>/*.jpg
    python -m mpsrun.testing.images data/shapes --layout split  # data/shapes/train|val/<class>/*.jpg
    python -m mpsrun.testing.images data/shapes --csv           # plus data/shapes/labels.csv

Each class is a shape (disc, square, cross, ...) in a class colour on a noisy background at
a random place and size, so a small CNN learns them in a few epochs and a flip or crop
keeps the label. Seeded: the same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import numpy as np

SHAPES = ("disc", "square", "cross", "ring", "bar", "triangle")
COLOURS = ((220, 60, 60), (60, 180, 75), (60, 90, 220), (240, 200, 40), (170, 60, 200), (40, 200, 200))


def draw(kind: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One (size, size, 3) uint8 image of shape `kind`."""
    img = rng.integers(0, 80, (size, size, 3)).astype(np.float32) + 90
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    r = size * rng.uniform(0.18, 0.3)
    cy, cx = rng.uniform(r, size - r, 2)
    dy, dx = yy - cy, xx - cx
    shape = SHAPES[kind % len(SHAPES)]
    if shape == "disc":
        mask = dy**2 + dx**2 <= r**2
    elif shape == "square":
        mask = (abs(dy) <= r * 0.8) & (abs(dx) <= r * 0.8)
    elif shape == "cross":
        mask = ((abs(dy) <= r * 0.25) & (abs(dx) <= r)) | ((abs(dx) <= r * 0.25) & (abs(dy) <= r))
    elif shape == "ring":
        mask = (dy**2 + dx**2 <= r**2) & (dy**2 + dx**2 >= (0.6 * r) ** 2)
    elif shape == "bar":
        mask = (abs(dy) <= r * 0.3) & (abs(dx) <= r)
    else:
        mask = (dy >= -r) & (dy <= r) & (abs(dx) <= (dy + r) / 2)
    img[mask] = COLOURS[kind % len(COLOURS)]
    return img.clip(0, 255).astype(np.uint8)


def write(
    folder: str | Path,
    classes: int = 3,
    per_class: int = 30,
    size: int = 64,
    layout: str = "flat",
    fmt: str = "jpg",
    val_per_class: int = 8,
    csv: bool = False,
    seed: int = 0,
) -> Path:
    """Write the images; returns the folder. layout: flat (<class>/) or split (train/ and val/ of that)."""
    from PIL import Image

    root = Path(folder)
    rng = np.random.default_rng(seed)
    names = [f"{SHAPES[k % len(SHAPES)]}{'' if k < len(SHAPES) else k}" for k in range(classes)]
    rows = []
    splits = [("", per_class)] if layout == "flat" else [("train", per_class), ("val", val_per_class)]
    for split, n in splits:
        for k, name in enumerate(names):
            d = root / split / name if split else root / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                p = d / f"{i:04d}.{fmt}"
                Image.fromarray(draw(k, size, rng)).save(p, quality=90) if fmt in ("jpg", "jpeg") else Image.fromarray(draw(k, size, rng)).save(p)
                rows.append((p.relative_to(root).as_posix(), name))
    if csv:
        (root / "labels.csv").write_text("path,label\n" + "".join(f"{p},{lab}\n" for p, lab in rows))
    return root


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mpsrun.testing.images", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--classes", type=int, default=3)
    ap.add_argument("--per-class", type=int, default=60)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--layout", choices=("flat", "split"), default="flat")
    ap.add_argument("--format", choices=("jpg", "png", "webp", "bmp"), default="jpg")
    ap.add_argument("--csv", action="store_true", help="also write labels.csv (path,label)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    root = write(a.folder, a.classes, a.per_class, a.size, a.layout, a.format, csv=a.csv, seed=a.seed)
    print(f"wrote {a.classes} classes of {a.per_class} images ({a.size}px {a.format}) to {root}")


if __name__ == "__main__":
    main()
