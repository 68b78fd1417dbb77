"""Passed / failed / skipped from pytest's report log (pytest-reportlog: one JSON line per test as it ends, so a
gate cut off by its time limit still says what ran), each failure with the last line of its reason, skips grouped."""

from __future__ import annotations

import collections
import json
import re
import sys


def _reason(longrepr: object) -> str:
    if isinstance(longrepr, dict):
        crash = (longrepr.get("reprcrash") or {}) if isinstance(longrepr.get("reprcrash"), dict) else {}
        return str(crash.get("message") or longrepr)[:300].replace("\n", " | ")
    if isinstance(longrepr, (list, tuple)) and longrepr:
        return str(longrepr[-1])[:200]  # a skip: (file, line, reason)
    return str(longrepr)[:300].replace("\n", " | ")


def plain(nodeid: str) -> str:
    """The nodeid without xdist's loadgroup suffix (`nodeid@group`, the gate's --dist loadgroup)."""
    return nodeid.rsplit("@", 1)[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def main(path: str, log: str | None = None) -> int:
    outcome: dict[str, str] = {}
    reason: dict[str, str] = {}
    took: dict[str, float] = collections.defaultdict(float)
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # the last line of a log cut by a kill
                continue
            if r.get("$report_type") != "TestReport":
                if r.get("$report_type") == "CollectReport" and r.get("outcome") == "failed":  # exit 1 too
                    outcome[r["nodeid"]], reason[r["nodeid"]] = "error", f"collection: {_reason(r.get('longrepr'))}"
                continue
            node, when = plain(r["nodeid"]), r["when"]
            took[node] += float(r.get("duration") or 0)
            if r["outcome"] == "failed":
                outcome[node] = "failed" if when == "call" else "error"
                reason[node] = f"{when}: {_reason(r.get('longrepr'))}"
            elif r["outcome"] == "skipped" and outcome.get(node) not in ("failed", "error"):
                outcome[node], reason[node] = "skipped", _reason(r.get("longrepr"))
            elif when == "call" and node not in outcome:
                outcome[node] = "passed"
    counts = collections.Counter(outcome.values())
    print(f"gpu gate summary: {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, {counts['skipped']} skipped")
    collected = _collected(log)
    ended = sum(1 for n in outcome if "::" in n)  # tests (a collection error's node is a file)
    if collected is not None and ended < collected:
        print(f"  NOT RUN: {collected - ended} of the {collected} tests collected never ended (the gate was cut short)")
    for node, o in outcome.items():
        if o in ("failed", "error"):
            print(f"  {o.upper()} {node} ({took[node]:.0f} s): {reason[node]}")
    for why, n in collections.Counter(reason[n] for n, o in outcome.items() if o == "skipped").most_common():
        print(f"  skipped x{n}: {why}")
    slow = sorted(took.items(), key=lambda kv: -kv[1])[:10]
    print("  slowest: " + ", ".join(f"{n.split('::')[-1]} {t:.0f} s" for n, t in slow))
    return 1 if counts["failed"] or counts["error"] or (collected is not None and ended < collected) else 0


def _collected(log: str | None) -> int | None:
    """How many tests pytest collected, from its output (`12 workers [571 items]` under xdist, else `collected 571 items`)."""
    if not log:
        return None
    try:
        text = open(log, errors="replace").read()
    except OSError:
        return None
    m = re.search(r"workers \[(\d+) items?\]", text) or re.search(r"collected (\d+) items?", text)
    return int(m.group(1)) if m else None


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
