"""How fast can P processes store decoded rows, with no decoding at all? (issue 25, the first run's decoding)

The image cache build decodes at 12,000-16,000 img/s on the H100 machine's 16 cores with nothing
stored, but builds at 3,400-5,200: this isolates the store. Each of P forked processes takes
32-row chunks from a shared counter and writes rows of C*H*W bytes (a 256px RGB image: 196,608)
by one method, timed from the fork to the last process's exit:

- ``map``: a shared map of the cache file, each row's pages populated with MADV_POPULATE_WRITE (today's store);
- ``map-falloc``: the same after ``posix_fallocate`` of the whole file (blocks reserved up front);
- ``pwrite``: one ``pwritev`` per row into the file (the store before the map);
- ``anon``: a shared anonymous map (no file: what a store in memory costs), populated the same way.

    python benchmarks/decode_store_probe.py --rows 10200 --procs 15
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np

POPULATE = 23  # MADV_POPULATE_WRITE


def store(method: str, path: str, rows: int, row: int, lo: object, lock: object, src: bytes) -> None:
    fd = os.open(path, os.O_RDWR) if method != "anon" else -1
    mm = None
    if method in ("map", "map-falloc"):
        mm = mmap.mmap(fd, rows * row, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    elif method == "anon":
        mm = ANON
    page = mmap.PAGESIZE
    while True:
        with lock:  # type: ignore[attr-defined]
            a = lo.value  # type: ignore[attr-defined]
            lo.value = min(a + 32, rows)  # type: ignore[attr-defined]
        if a >= rows:
            break
        for i in range(a, min(a + 32, rows)):
            if mm is not None:
                start = i * row - (i * row) % page
                mm.madvise(POPULATE, start, (i + 1) * row - start)
                mm[i * row:(i + 1) * row] = src
            else:
                os.pwritev(fd, [src], i * row)
    if fd >= 0:
        os.close(fd)


ANON: mmap.mmap | None = None


def one(method: str, folder: str, rows: int, row: int, procs: int) -> float:
    global ANON
    path = os.path.join(folder, f"probe-{method}-{time.monotonic_ns()}.u8")
    if method != "anon":
        with open(path, "wb") as f:
            f.truncate(rows * row)
        if method == "map-falloc":
            fd = os.open(path, os.O_RDWR)
            os.posix_fallocate(fd, 0, rows * row)
            os.close(fd)
    else:
        ANON = mmap.mmap(-1, rows * row, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    ctx = mp.get_context("fork")
    lo, lock = ctx.RawValue("q", 0), ctx.Lock()
    src = np.random.default_rng(0).integers(0, 256, row, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    ps = [ctx.Process(target=store, args=(method, path, rows, row, lo, lock, src)) for _ in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    took = time.perf_counter() - t0
    if ANON is not None:
        ANON.close()
        ANON = None
    if os.path.exists(path):
        os.unlink(path)
    return rows / took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=10200)
    ap.add_argument("--row", type=int, default=3 * 256 * 256)
    ap.add_argument("--procs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=os.environ.get("MPSRUN_CACHE") or os.path.expanduser("~/.cache/mpsrun"))
    ap.add_argument("--methods", default="map,map-falloc,pwrite,anon")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    folder = tempfile.mkdtemp(dir=a.dir, prefix=".probe-")
    print(f"{a.rows:,} rows of {a.row:,} bytes, {a.procs} processes, into {folder} "
          f"({os.popen(f'df -T {folder} | tail -1').read().split()[1] if sys.platform.startswith('linux') else '?'})")
    print("| method | img/s (each) | median |\n| --- | --- | ---: |")
    methods = a.methods.split(",")
    got: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(a.repeats):
        for m in methods:  # interleaved
            got[m].append(one(m, folder, a.rows, a.row, a.procs))
    for m in methods:
        print(f"| {m} | {', '.join(f'{v:,.0f}' for v in got[m])} | {statistics.median(got[m]):,.0f} |")
    os.rmdir(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
