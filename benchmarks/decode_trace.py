"""Where a cache build's decode phase goes, worker by worker (issue 25: the first run's decoding).

PIL alone decodes 12,600-13,700 img/s in 16 warm processes on the H100 machine, the build's decode
phase about 7,000. This times one cold build (torch imported first, as in a run) with every worker's
entry, first chunk, last chunk and exit stamped (the workers are forked, so wrapping
`decode._decode_claims` here reaches them), and says how much of the phase is the start (fork to a
worker's first chunk done), the steady part and the end (a worker's last chunk to the build's join).

    python benchmarks/decode_trace.py --n 10000 --size 256 [--source 1024] [--modes cpu,auto]

Modes build the same folder in turn, each into a fresh cache: `cpu` PIL only (MPSRUN_IMAGE_DECODE=cpu),
`auto` as a run does (nvJPEG where it can help). Put `cpu` first: it never starts CUDA, so `auto` after it
is as cold as a first run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402,F401 - as in a run: the workers are forked from a process with torch loaded

import images_bench  # noqa: E402


def one(mode: str, root: Path, size: int, stamps: Path, image_folder) -> None:  # type: ignore[no-untyped-def]
    os.sync()
    t0 = time.time()
    splits = image_folder(str(root), size=size)
    t1 = time.time()
    tags = splits.info["tags"]
    n = len(splits.train) + len(splits.val)
    print(f"[{mode}] whole build {n:,} images in {t1 - t0:.2f} s = {n / (t1 - t0):,.0f} img/s ({tags.get('mpsrun.data.decode', '')}; "
          f"{tags.get('mpsrun.data.decode_phases', '')})")
    ws = [json.loads(p.read_text()) for p in stamps.glob("*.json")]
    ws = [w for w in ws if w["chunks"]]
    enter = [w["enter"] - t0 for w in ws]
    first = [w["chunks"][0][0] - t0 for w in ws]
    last = [w["chunks"][-1][0] - t0 for w in ws]
    leave = [w["leave"] - t0 for w in ws]
    count = [sum(c[1] for c in w["chunks"]) for w in ws]
    per_chunk = [(w["chunks"][i][0] - w["chunks"][i - 1][0]) / w["chunks"][i][1] * 1e3 for w in ws for i in range(1, len(w["chunks"]))]
    print(f"{len(ws)} PIL workers, seconds from the build's call: entered {min(enter):.2f}-{max(enter):.2f}, first chunk done "
          f"{min(first):.2f}-{max(first):.2f}, last chunk done {min(last):.2f}-{max(last):.2f}, left {min(leave):.2f}-{max(leave):.2f}; "
          f"build returned {t1 - t0:.2f}")
    print(f"images per worker {min(count)}-{max(count)}; steady ms per image per worker: median {statistics.median(per_chunk):.2f} "
          f"(p10 {sorted(per_chunk)[len(per_chunk) // 10]:.2f}, p90 {sorted(per_chunk)[9 * len(per_chunk) // 10]:.2f}) "
          f"= {len(ws) * 1e3 / statistics.median(per_chunk):,.0f} img/s for all workers at that pace")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--source", type=int, default=None, help="side of the written JPEGs (default: --size)")
    ap.add_argument("--modes", default="auto", help="comma-separated: cpu (PIL only), auto (as a run)")
    a = ap.parse_args()
    from mpsrun.plugins.builtin.images import decode
    from mpsrun.plugins.builtin.images.datasets import image_folder

    tmp = Path(tempfile.mkdtemp(prefix="decode-trace-"))
    root = tmp / "jpegs"
    t = time.perf_counter()
    images_bench.write_folder(root, a.n, 10, a.source or a.size, max(20, a.n // 50))
    print(f"wrote {a.n:,} {a.source or a.size}px JPEGs in {time.perf_counter() - t:.1f} s", flush=True)
    stamps = tmp / "stamps"
    stamps.mkdir()
    inner = decode._decode_claims

    def traced(out, shape, paths, order, claims, report):  # type: ignore[no-untyped-def]
        marks = {"enter": time.time(), "chunks": []}

        def rep(n, bad):  # type: ignore[no-untyped-def]
            marks["chunks"].append((time.time(), n))
            report(n, bad)

        try:
            inner(out, shape, paths, order, claims, rep)
        finally:
            marks["leave"] = time.time()
            (stamps / f"{os.getpid()}.json").write_text(json.dumps(marks))

    decode._decode_claims = traced
    for mode in a.modes.split(","):
        for f in stamps.glob("*.json"):
            f.unlink()
        os.environ["MPSRUN_CACHE"] = str(tmp / f"cache-{mode}")
        os.environ["MPSRUN_IMAGE_DECODE"] = mode
        one(mode, root, a.size, stamps, image_folder)
        shutil.rmtree(tmp / f"cache-{mode}", ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
