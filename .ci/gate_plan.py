"""Model the GPU gate's wall time from pytest-reportlog files, to choose workers and distribution without the GPU.

    python .ci/gate_plan.py LOCAL.jsonl [GPU.jsonl ...] [--workers 8,12] [--split FILE,FILE] [--weights .ci/gate_weights.json]

LOCAL: the whole suite's report log (any machine: every test is in it). GPU: report logs from the GPU machine, whole
or cut short (a cut gate still logs each test as it ends). A test's GPU seconds are its measured GPU seconds where a
GPU log has it (times --scale: a what-if for a measured run's contention gone), else its local seconds times --ratio
(default: the median GPU/local ratio of the tests measured on both); 0 for the Triton interpreter checks, which skip on
a CUDA machine; --cuda-only seconds for a test skipped locally (no CUDA) and not measured. Module-scoped fixtures count
in the first test of a module, so a file's seconds are the sum of its tests.

Makespans are simulated as pytest-xdist 3.8 hands out units (checked against a whole local run: 947 s simulated, 929 s
measured): a worker takes one unit, and another whenever 2 or fewer of its tests have not ended (it runs a test only
once it knows the next). Columns: `loadfile` (whole files, most tests first: xdist's order), longest file first, the
gate plugin (.ci/gate_plugin.py: the --split files test by test, every unit longest first), the same handing the
shortest unit left to a worker that still has one running, and LPT over single tests (the floor, as if every test
could go anywhere).

--weights writes the per-test GPU estimate ("gpu") and the local seconds ("cpu") for .ci/gate_plugin.py's order.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import statistics
import sys


def plain(nodeid: str) -> str:
    """The nodeid without xdist's loadgroup suffix (`nodeid@group`)."""
    return nodeid.rsplit("@", 1)[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def per_test(path: str) -> tuple[dict[str, float], set[str]]:
    """nodeid -> seconds (setup + call + teardown) for each test the log says ended, and the skipped ones."""
    took: dict[str, float] = collections.defaultdict(float)
    skipped: set[str] = set()
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a log cut mid-line
                continue
            if r.get("$report_type") == "TestReport":
                took[plain(r["nodeid"])] += float(r.get("duration") or 0)
                if r.get("outcome") == "skipped":
                    skipped.add(plain(r["nodeid"]))
    return dict(took), skipped


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def loadfile(files: list[tuple[str, list[float]]], workers: int, reserve_smallest: bool = False) -> tuple[float, dict[int, list[str]]]:
    """xdist's LoadScopeScheduling over units in queue order: the makespan and each worker's units.

    A worker gets one unit, then one more whenever its tests not yet ended are 2 or fewer (a worker runs a test only
    once it knows the next). reserve_smallest: that extra unit is the smallest left (the gate plugin), not the next.
    """
    queue = collections.deque(files)
    clock = [0.0] * workers
    took: dict[int, list[str]] = collections.defaultdict(list)
    pending: list[collections.deque[float]] = [collections.deque() for _ in range(workers)]  # not yet started

    def give(w: int) -> None:
        name, tests = queue.pop() if reserve_smallest and pending[w] else queue.popleft()
        pending[w].extend(tests)
        took[w].append(name)

    for w in range(workers):
        if queue:
            give(w)
    for w in range(workers):
        if queue and len(pending[w]) <= 2:
            give(w)
    events = [(0.0, w) for w in range(workers)]
    heapq.heapify(events)
    while events:
        t, w = heapq.heappop(events)  # worker w's test ended at t (or it starts)
        if queue and len(pending[w]) <= 2 and t > 0:
            give(w)
        if not pending[w]:
            continue
        clock[w] = t + pending[w].popleft()
        heapq.heappush(events, (clock[w], w))
    return max(clock), took


def lpt(items: list[float], workers: int) -> float:
    loads = [0.0] * workers
    heapq.heapify(loads)
    for d in sorted(items, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + d)
    return max(loads)


def units(est: dict[str, dict[str, float]], split: set[str]) -> list[tuple[str, list[float]]]:
    """The gate plugin's units, longest first: a split file's tests one by one, every other file whole."""
    out: list[tuple[str, list[float]]] = []
    for f, tests in est.items():
        if f in split:
            out.extend((k, [v]) for k, v in tests.items())
        else:
            out.append((f, list(tests.values())))
    return sorted(out, key=lambda u: -sum(u[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("local")
    ap.add_argument("gpu", nargs="*")
    ap.add_argument("--workers", default="6,8,10,12,14,16")
    ap.add_argument("--weights", help="write the per-test GPU estimate and the local seconds here (JSON, for .ci/gate_plugin.py)")
    ap.add_argument("--ratio", type=float, help="GPU/local ratio for tests without a GPU measurement (default: the median)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the GPU-measured seconds (a what-if: a measured run's contention gone)")
    ap.add_argument("--cuda-only", type=float, default=10.0,
                    help="seconds for a test skipped in the local log (no CUDA there) without a GPU measurement")
    ap.add_argument("--skips-on-cuda", default="interpreter",
                    help="nodeid substring of tests that skip on a CUDA machine (Triton interpreter checks): 0 s")
    ap.add_argument("--split", default="", help="comma-separated files the gate plugin runs test by test")
    a = ap.parse_args()

    local, local_skipped = per_test(a.local)
    gpu: dict[str, float] = {}
    for g in a.gpu:
        for k, v in per_test(g)[0].items():
            gpu[k] = max(v, gpu.get(k, 0.0))
    both = [gpu[k] / local[k] for k in gpu if k in local and local[k] > 0.5]
    med = statistics.median(both) if both else 1.0
    q75 = statistics.quantiles(both, n=4)[2] if len(both) > 3 else med
    ratio = a.ratio or med
    print(f"{len(local)} tests in the local log ({sum(local.values()):.0f} s), {len(gpu)} measured on the GPU; "
          f"GPU/local ratio over {len(both)} tests measured on both (> 0.5 s locally): median {med:.2f}, "
          f"p75 {q75:.2f}; used for the rest: {ratio:.2f}; measured GPU seconds x {a.scale:g}")

    est: dict[str, dict[str, float]] = collections.defaultdict(dict)
    measured: collections.Counter[str] = collections.Counter()
    for k in list(local) + [k for k in gpu if k not in local]:
        f = file_of(k)
        if k in gpu:
            est[f][k] = gpu[k] * a.scale
            measured[f] += 1
        elif a.skips_on_cuda and a.skips_on_cuda in k:
            est[f][k] = 0.0
        elif k in local_skipped:
            est[f][k] = a.cuda_only
        else:
            est[f][k] = local[k] * ratio
    per_file = {f: sum(v.values()) for f, v in est.items()}
    loc_file: dict[str, float] = collections.defaultdict(float)
    for k, v in local.items():
        loc_file[file_of(k)] += v
    total = sum(per_file.values())
    print(f"\nGPU estimate: {total:.0f} s of tests in all (local {sum(loc_file.values()):.0f} s)")
    print(f"{'file':40s} {'GPU est s':>9s} {'local s':>8s} {'tests':>5s} {'on GPU':>6s}  longest test (GPU est s)")
    for f, s in sorted(per_file.items(), key=lambda kv: -kv[1]):
        top = max(est[f].values()) if est[f] else 0
        print(f"{f:40s} {s:9.0f} {loc_file.get(f, 0):8.0f} {len(est[f]):5d} {measured[f]:6d}  {top:5.0f}")

    split = {x for x in a.split.split(",") if x}
    files = [(f, list(v.values())) for f, v in est.items()]
    by_count = sorted(files, key=lambda kv: -len(kv[1]))  # xdist's default reorder: most tests first
    by_weight = sorted(files, key=lambda kv: -sum(kv[1]))
    longest = max(d for v in est.values() for d in v.values())
    print(f"\nmakespan, s (pytest's own time; the floor: total / workers or the longest test, {longest:.0f} s)")
    print(f"{'workers':>7s} {'floor':>6s} {'loadfile':>9s} {'loadfile longest 1st':>21s} {'gate plugin':>12s} "
          f"{'(reserve smallest)':>19s} {'LPT per test':>13s}")
    for n in (int(x) for x in a.workers.split(",")):
        print(f"{n:7d} {max(total / n, longest):6.0f} {loadfile(by_count, n)[0]:9.0f} {loadfile(by_weight, n)[0]:21.0f} "
              f"{loadfile(units(est, split), n)[0]:12.0f} {loadfile(units(est, split), n, True)[0]:19.0f} "
              f"{lpt([d for v in est.values() for d in v.values()], n):13.0f}")
    if a.weights:
        with open(a.weights, "w") as f:
            json.dump({"made_by": "python .ci/gate_plan.py " + " ".join(sys.argv[1:]),
                       "gpu": {k: round(v, 1) for f_ in sorted(est) for k, v in est[f_].items()},
                       "cpu": {k: round(v, 1) for k, v in sorted(local.items())}}, f, indent=0)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
