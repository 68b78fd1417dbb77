"""Read a py-spy raw profile (`py-spy record --format raw --subprocesses --idle`) of one `mpsrun run` and say
where each process spent its time: sampled seconds per process (all its threads, idle ones included), then the
main thread's frames below an anchor.

    python benchmarks/spy_summary.py spy.txt.gz                        # seconds per process
    python benchmarks/spy_summary.py spy.txt.gz --process '""' --anchor "execute (mpsrun/train/runner.py" --depth 2
    python benchmarks/spy_summary.py spy.txt.gz --process helper.process --anchor "log_exported (" --depth 4

Seconds are samples / rate (`--rate`, py-spy's default 100; startup_profile_gpu.sh records at 250). Only the
main thread's samples count below an anchor (its stack starts at the interpreter's entry), so a helper thread's
waits are not added to the run's own.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", help="py-spy's raw output (gzip'd or not)")
    ap.add_argument("--rate", type=float, default=250.0, help="samples a second it was recorded at")
    ap.add_argument("--process", help="only the process whose py-spy label contains this text")
    ap.add_argument("--anchor", help="break down the main thread's samples from the first frame containing this text")
    ap.add_argument("--depth", type=int, default=3, help="frames shown below the anchor")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    opener = gzip.open if a.raw.endswith(".gz") else open
    procs: collections.Counter[str] = collections.Counter()
    below: collections.Counter[str] = collections.Counter()
    with opener(a.raw, "rt") as f:  # type: ignore[operator]
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            frames, n = stack.split(";"), int(count)
            marks = [i for i, x in enumerate(frames) if x.startswith("process ")]
            proc = frames[marks[-1]][:100] if marks else "?"
            if a.process and a.process not in proc:
                continue
            procs[proc] += n
            body = frames[marks[-1] + 1:] if marks else frames
            if not a.anchor or not body or not (body[0].startswith("<module>") or "_run_module_as_main" in body[0]):
                continue  # another thread's stack
            at = next((i for i, x in enumerate(body) if a.anchor in x), None)
            if at is not None:
                below[" > ".join(re.sub(r" \(.*/", " (", x) for x in body[at:at + a.depth])] += n
    rows = below if a.anchor else procs
    for key, n in rows.most_common(a.top):
        print(f"{n / a.rate:7.2f} s  {key[:300]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
