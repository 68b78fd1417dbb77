"""Which image files make up a dataset, and their labels: folders or a CSV, checked before any decoding.

Everything here only lists and stats files (no image is opened), so every mistake a user
can make in the layout (a missing root, an empty class folder, one class, a CSV column that
does not exist, a validation label that training lacks) is bad input, said with what to fix,
in well under a second and before the heavy part (decoding) starts.
"""

from __future__ import annotations

import csv as csv_mod
import difflib
import os
import stat as stat_mod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp")  # any case (.JPG); .jfif: what browsers save JPEGs as
SPLITS = ("train", "val", "test")


@dataclass
class Listing:
    """Files per split with their labels (class indices), and the class names in index order."""

    classes: list[str]
    files: dict[str, list[Path]] = field(default_factory=dict)  # split -> files (train always; val, test when given)
    labels: dict[str, list[int]] = field(default_factory=dict)
    source: str = ""  # the folder or CSV read: recorded with the run's datasets
    stats: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (size, mtime_ns): the listing's one stat per file, which the cache key reuses

    def all_files(self) -> list[Path]:
        return [p for s in SPLITS for p in self.files.get(s, [])]


def resolve_path(value: str, recipe_dir: Optional[str], what: str) -> Path:
    """An absolute path as is; a relative one from the working folder, else from the recipe's folder."""
    p = Path(value).expanduser()
    if p.is_absolute():
        if not p.exists():
            raise FileNotFoundError(f"{what} {p} does not exist")
        return p
    tried = [Path.cwd() / p] + ([Path(recipe_dir) / p] if recipe_dir else [])
    for cand in tried:
        if cand.exists():
            return cand.resolve()
    raise FileNotFoundError(f"{what} '{value}' does not exist (looked in {' and '.join(str(t) for t in tried)})")


def is_image(name: str) -> bool:
    """Image files by extension; hidden files (.DS_Store, ._x.jpg from macOS) and others are ignored."""
    return not name.startswith(".") and name.lower().endswith(EXTENSIONS)


def _images_under(folder: Path, stats: Optional[dict[str, tuple[int, int]]] = None) -> list[Path]:
    """Image files under `folder` (sorted, sub-folders followed, links too), each stat-ed once: `os.scandir`'s entries
    know file from folder without a call, and `DirEntry.stat()` is the one `stat` a file costs (kept in `stats`
    for the cache key, which would otherwise stat every file again)."""
    out: list[Path] = []
    todo = [str(folder)]
    seen: set[tuple[int, int]] = set()  # (device, inode) of the folders walked: a link back up is not followed twice
    while todo:
        d = todo.pop()
        try:
            st = os.stat(d)
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        base = Path(d)  # parsed once: Path(entry.path) would parse the whole path per file (0.5 s of 100,000)
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_dir():
                subdirs.append(e.path)
            elif is_image(e.name):
                try:
                    est = e.stat()
                except OSError:
                    continue  # a dangling link: nothing to decode
                if stats is not None:
                    stats[e.path] = (est.st_size, est.st_mtime_ns)
                out.append(base / e.name)
        todo += reversed(subdirs)  # depth first, in name order, as os.walk listed them
    return out


def _class_dirs(folder: Path) -> list[Path]:
    return sorted((d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")), key=lambda d: d.name)


def _read_classes(folder: Path, where: str, stats: Optional[dict[str, tuple[int, int]]] = None) -> dict[str, list[Path]]:
    dirs = _class_dirs(folder)
    if not dirs:
        raise ValueError(f"{where} {folder} has no class folders: put each class's images in a folder of its own ({folder}/cat/1.jpg, {folder}/dog/2.jpg)")
    found = {d.name: _images_under(d, stats) for d in dirs}
    empty = [n for n, files in found.items() if not files]
    if empty:
        raise ValueError(
            f"{where} {folder}: class folder(s) {', '.join(repr(e) for e in empty)} hold no images "
            f"({', '.join(EXTENSIONS)}): add images or remove the folder"
        )
    return found


def scan_folder(root: Path) -> Listing:
    """`root/<class>/...` or `root/train/<class>/...` with optional `val/` and `test/` beside it."""
    if not root.is_dir():
        raise FileNotFoundError(f"dataset.root {root} is not a folder")
    if (root / "train").is_dir():
        stats: dict[str, tuple[int, int]] = {}
        train = _read_classes(root / "train", "dataset.root's train/", stats)
        classes = sorted(train)
        listing = Listing(classes, source=str(root), stats=stats)
        index = {c: i for i, c in enumerate(classes)}
        listing.files["train"] = [p for c in classes for p in train[c]]
        listing.labels["train"] = [index[c] for c in classes for _ in train[c]]
        for split in ("val", "test"):
            if not (root / split).is_dir():
                continue
            found = _read_classes(root / split, f"dataset.root's {split}/", stats)
            unknown = sorted(set(found) - set(classes))
            if unknown:
                raise ValueError(
                    f"dataset.root's {split}/ has class folder(s) {', '.join(repr(u) for u in unknown)} that train/ lacks "
                    f"(train/ has {', '.join(classes)}): rename or remove them, or add training images for them"
                )
            names = sorted(found)
            listing.files[split] = [p for c in names for p in found[c]]
            listing.labels[split] = [index[c] for c in names for _ in found[c]]
    else:
        stats = {}
        found = _read_classes(root, "dataset.root", stats)
        classes = sorted(found)
        listing = Listing(classes, source=str(root), stats=stats)
        listing.files["train"] = [p for c in classes for p in found[c]]
        listing.labels["train"] = [i for i, c in enumerate(classes) for _ in found[c]]
    if len(listing.classes) < 2:
        raise ValueError(f"{root} has a single class ({listing.classes[0]!r}): a classifier needs at least two class folders")
    return listing


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=2, cutoff=0.6)
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)" if close else ""


def scan_csv(path: Path, path_column: str, label_column: str) -> Listing:
    """A CSV with a path column (relative to the CSV's folder) and a label column (class names or integers)."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset.csv {path} is not a file")
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv_mod.DictReader(f)
        columns = list(reader.fieldnames or [])
        for key, col in (("path_column", path_column), ("label_column", label_column)):
            if col not in columns:
                raise ValueError(
                    f"dataset.{key}: {path.name} has no column {col!r}{_did_you_mean(col, columns)}; its columns: {', '.join(columns) or 'none'}"
                )
        rows = [(r[path_column], (r[label_column] or "").strip()) for r in reader]
    if not rows:
        raise ValueError(f"dataset.csv {path} has no rows")
    base = path.parent
    files, raw, missing = [], [], []
    stats: dict[str, tuple[int, int]] = {}
    for rel, label in rows:
        p = Path(rel.strip()).expanduser()
        p = p if p.is_absolute() else base / p
        if not is_image(p.name):
            continue  # not an image file: ignored, like in folders
        try:
            st = os.stat(p)  # the one stat of this file; the cache key reuses it
        except OSError:
            st = None
        if st is None or not stat_mod.S_ISREG(st.st_mode):
            missing.append(rel)
            continue
        stats[str(p)] = (st.st_size, st.st_mtime_ns)
        if label == "":
            raise ValueError(f"dataset.csv {path}: row for {rel!r} has an empty {label_column!r}")
        files.append(p)
        raw.append(label)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:3])
        raise FileNotFoundError(f"dataset.csv {path}: {len(missing)} listed image(s) do not exist ({shown}{', ...' if len(missing) > 3 else ''}); paths are read relative to the CSV's folder")
    if all(_is_int(v) for v in raw):
        ints = [int(v) for v in raw]
        if min(ints) < 0:
            raise ValueError(f"dataset.csv {path}: integer labels must be 0 or more, found {min(ints)}")
        classes = [str(i) for i in range(max(ints) + 1)]
        labels = ints
    else:
        classes = sorted(set(raw))
        index = {c: i for i, c in enumerate(classes)}
        labels = [index[v] for v in raw]
    if len(set(labels)) < 2:
        raise ValueError(f"dataset.csv {path} has a single class ({classes[labels[0]]!r}): a classifier needs at least two")
    return Listing(classes, {"train": files}, {"train": labels}, source=str(path), stats=stats)


def _is_int(v: str) -> bool:
    try:
        int(v)
        return True
    except ValueError:
        return False
