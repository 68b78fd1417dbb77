"""Passed / failed / skipped of a JUnit report, the reasons of each failure and skip grouped (the GPU gate's summary)."""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET


def main(path: str) -> int:
    root = ET.parse(path).getroot()
    counts: collections.Counter[str] = collections.Counter()
    failed: list[tuple[str, str]] = []
    skipped: collections.Counter[str] = collections.Counter()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            counts["failed"] += 1
            failed.append((name, (bad.get("message") or "").splitlines()[0][:300] if bad.get("message") else ""))
        elif skip is not None:
            counts["skipped"] += 1
            skipped[(skip.get("message") or "").splitlines()[0][:200] if skip.get("message") else "?"] += 1
        else:
            counts["passed"] += 1
    print(f"gpu gate summary: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    for name, msg in failed:
        print(f"  FAILED {name}: {msg}")
    for reason, n in skipped.most_common():
        print(f"  skipped x{n}: {reason}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
