"""The GPU gate's test order and units of work (a pytest plugin: `.ci/gpu` runs pytest with `-p gate_plugin
--dist loadfile --no-loadscope-reorder`, .ci on PYTHONPATH). The CPU CI does not load it.

Why: under plain `--dist loadfile` a worker runs a whole file and xdist hands out the files with the most tests first,
so the gate's wall time was set by its longest file (test_distributed.py: minutes on the GPU machine, spawning rank
processes) and by long files handed out last. Here:
- a long file (over SPLIT_ABOVE_S estimated GPU seconds) whose tests share nothing is split: each test is its own
  unit, so its slow tests run side by side on several workers. A file with a module/class/package-scoped fixture of
  the suite's own, or a session fixture that starts something (mlflow_server), stays whole: splitting it would build
  that fixture again on each worker taking a piece;
- every other file stays whole (loadfile's behaviour);
- units go out longest first (estimated GPU seconds from .ci/gate_weights.json, which `.ci/gate_plan.py --weights`
  makes from measured report logs), so short ones fill the end instead of a long one starting last. (xdist gives a worker
  a second unit while its first runs; `.ci/gate_plan.py` found handing the shortest one left there worse: the end
  then lacks short units to fill it.) A test that file does not know counts UNKNOWN_S. GATE_WEIGHTS=cpu takes
  the seconds measured on the 2-core CPU machine instead (the CPU CI could use this order too: there the Triton
  interpreter checks, skipped on a GPU, are among the longest tests).

How: the workers collect, sort the items and write the split files to $GATE_SPLIT_FILE (the controller made it); the
controller's scheduler (LoadFileScheduling with a test's own nodeid as the unit for a split file) reads it once every
worker has collected. (xdist's loadgroup marks are not used: under pytest 9.2 its nodeid suffix no longer applies.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

WEIGHTS = Path(__file__).with_name("gate_weights.json")
SPLIT_ABOVE_S = 60.0
UNKNOWN_S = 5.0
CHEAP_SESSION_FIXTURES = {"template_db"}  # one small SQLite file per worker: nothing to save by keeping a file whole
ENV = "GATE_SPLIT_FILE"


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _shares_state(item: pytest.Item) -> bool:
    """Uses a fixture of the suite's that lives longer than one test (so the file's tests belong together)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", None)
    if defs is None:  # pytest's internals moved: keep the file whole (loadfile's behaviour) rather than guess
        return True
    for d in (d for ds in defs.values() for d in ds):
        if d.scope != "function" and str(getattr(d, "baseid", "tests")).startswith("tests") and d.argname not in CHEAP_SESSION_FIXTURES:
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and ENV not in os.environ:  # the controller (or a run without xdist)
        os.environ[ENV] = str(Path(tempfile.mkdtemp(prefix="gate-")) / "split.json")  # the workers it starts inherit it
        config.add_cleanup(lambda: shutil.rmtree(Path(os.environ.pop(ENV)).parent, ignore_errors=True))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = json.loads(WEIGHTS.read_text()).get(os.environ.get("GATE_WEIGHTS", "gpu"), {}) if WEIGHTS.exists() else {}
    weight = {it.nodeid: float(tests.get(it.nodeid, UNKNOWN_S)) for it in items}
    per_file: dict[str, float] = {}
    whole: set[str] = set()
    for it in items:
        f = _file(it.nodeid)
        per_file[f] = per_file.get(f, 0.0) + weight[it.nodeid]
        if _shares_state(it):
            whole.add(f)
    split = {f for f, s in per_file.items() if s > SPLIT_ABOVE_S and f not in whole}
    order = {id(it): i for i, it in enumerate(items)}
    unit = lambda it: weight[it.nodeid] if _file(it.nodeid) in split else per_file[_file(it.nodeid)]  # noqa: E731
    items.sort(key=lambda it: (-unit(it), order[id(it)]))
    if os.environ.get(ENV):
        tmp = f"{os.environ[ENV]}.{os.getpid()}"
        Path(tmp).write_text(json.dumps(sorted(split)))
        os.replace(tmp, os.environ[ENV])  # every worker writes the same list; whole files only


def pytest_report_header(config: pytest.Config) -> str:
    return (f"gpu gate order: longest units first from {WEIGHTS.name}"
            f"{'' if WEIGHTS.exists() else ' (missing: collection order)'}; files over {SPLIT_ABOVE_S:.0f} s "
            "without shared fixtures run test by test")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GateScheduling(LoadFileScheduling):  # type: ignore[misc]
        """loadfile, except that a split file's tests are units of their own."""

        split: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.split is None:  # first asked once every worker has collected (schedule())
                path = os.environ.get(ENV)
                self.split = set(json.loads(Path(path).read_text())) if path and Path(path).exists() else set()
                print(f"\ngpu gate: run test by test (the rest file by file): {', '.join(sorted(self.split)) or 'none'}", flush=True)
            f = _file(nodeid)
            return nodeid if f in self.split else f

    return GateScheduling(config, log)
