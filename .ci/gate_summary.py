"""Passed / failed / skipped from pytest's report log (pytest-reportlog: one JSON line per test as it ends, so a
gate cut off by its time limit still says what ran), each failure with the last line of its reason, skips grouped."""

from __future__ import annotations

import collections
import json
import sys


def _reason(longrepr: object) -> str:
    if isinstance(longrepr, dict):
        crash = (longrepr.get("reprcrash") or {}) if isinstance(longrepr.get("reprcrash"), dict) else {}
        return str(crash.get("message") or longrepr)[:300].replace("\n", " | ")
    if isinstance(longrepr, (list, tuple)) and longrepr:
        return str(longrepr[-1])[:200]  # a skip: (file, line, reason)
    return str(longrepr)[:300].replace("\n", " | ")


def main(path: str) -> int:
    outcome: dict[str, str] = {}
    reason: dict[str, str] = {}
    took: dict[str, float] = collections.defaultdict(float)
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("$report_type") != "TestReport":
                continue
            node, when = r["nodeid"], r["when"]
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
    for node, o in outcome.items():
        if o in ("failed", "error"):
            print(f"  {o.upper()} {node} ({took[node]:.0f} s): {reason[node]}")
    for why, n in collections.Counter(reason[n] for n, o in outcome.items() if o == "skipped").most_common():
        print(f"  skipped x{n}: {why}")
    slow = sorted(took.items(), key=lambda kv: -kv[1])[:10]
    print("  slowest: " + ", ".join(f"{n.split('::')[-1]} {t:.0f} s" for n, t in slow))
    return 1 if counts["failed"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
