"""Shared fixtures: a real MLflow SQLite store per test, the real CLI, fake installed plugins.

Creating an MLflow SQLite database runs its migrations (seconds), so one template
is made per session and copied into each test's own directory.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


def _share_cores() -> None:
    """Each pytest-xdist worker gets its share of the cores for torch's threads, before torch is imported.

    Why: with `-n 2` on 2 cores, two workers with 2 OpenMP threads each (and what they start) oversubscribe the CPU,
    and OpenMP's waiting threads then cost more than the work: on a 2-core machine with the other core busy,
    test_controls.py and test_engine.py took 80 s with 2 threads and 42 s with 1 (issue 53). The processes a test
    starts inherit the setting; a variable the user set is kept. The GPU gate (.ci/gpu) does the same.
    """
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = str(max(1, cores // max(1, int(workers))))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, threads)
    if "torch" in sys.modules:  # a plugin imported it first: its pool is sized already, so size it again
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_cores()
RECIPES = ROOT / "recipes"


@pytest.fixture(scope="session")
def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlflow.tracking import MlflowClient

    d = tmp_path_factory.mktemp("template")
    db = d / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory, template_db: Path):  # type: ignore[no-untyped-def]
    """One real `mlflow server` (SQLite, artifacts in tmp) for every module that needs a tracking server.

    Starting one is seconds of a 2-core machine's time; the tests that use it write their own
    experiments and runs, and a test that stops it starts it again (test_tracking_server.py).
    """
    import signal

    from tests.proc_helpers import MlflowServer

    s = MlflowServer(tmp_path_factory.mktemp("mlflow-server"), template_db)
    s.start()
    yield s
    s.kill(signal.SIGTERM)


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


class Workdir:
    """A user's working directory with the embedded default store under ./mlruns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.uri = f"sqlite:///{path / 'mlruns' / 'mlflow.db'}"

    def cli(self, *args: str, helper: str | None = "thread") -> Result:
        """The real Typer app, in-process (no mocks; saves a Python start per call).

        `helper`: the MLflow helper mode for this call. In-process calls use "thread" (the
        mode macOS/MPS users get): the test process has mlflow imported already, so no helper
        interpreter is started (~3 s a run on 2 cores). None keeps the product default
        (auto: a helper process), for tests about what a default run records; a test that set
        $MPSRUN_MLFLOW_HELPER itself keeps its own value. Tests that start `mpsrun` as a
        subprocess (console script, `--nproc`, torchrun, signals) are not affected and run the
        default helper process; processes an in-process call starts (`bench --parallel`
        cells) would inherit the mode, so that test passes helper=None.
        """
        import os

        from mpsrun.cli import app

        env = {} if helper is None or "MPSRUN_MLFLOW_HELPER" in os.environ else {"MPSRUN_MLFLOW_HELPER": helper}
        r = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False, env=env)
        return Result(r.exit_code, r.stdout, r.stderr)

    def client(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def runs(self, experiment: str) -> list[Any]:
        c = self.client()
        exp = c.get_experiment_by_name(experiment)
        if exp is None:
            return []
        return c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self.client().get_metric_history(run_id, key)]

    def write(self, name: str, text: str) -> Path:
        p = self.path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
        return p


@pytest.fixture
def work(tmp_path: Path, template_db: Path, monkeypatch: pytest.MonkeyPatch) -> Workdir:
    (tmp_path / "mlruns").mkdir()
    shutil.copy(template_db, tmp_path / "mlruns" / "mlflow.db")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return Workdir(tmp_path)


def run_subprocess(*args: str, cwd: Path, env: dict[str, str] | None = None) -> Result:
    """The installed console script, as a user types it."""
    import os

    e = {**os.environ, **(env or {})}
    e.pop("MLFLOW_TRACKING_URI", None)
    p = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, env=e, timeout=600)
    return Result(p.returncode, p.stdout, p.stderr)


# ----------------------------------------------------------------------------- fake plugins


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Install a throwaway distribution with entry points: a real dist-info on sys.path.

    importlib.metadata discovers it exactly as it would a pip-installed package.
    """
    made: list[str] = []

    def make(
        dist: str, module_source: str, models: dict[str, str] | None = None, datasets: dict[str, str] | None = None,
        version: str = "0.1", callbacks: dict[str, str] | None = None,
    ) -> Path:
        site = tmp_path / f"site_{dist}"
        site.mkdir()
        mod = f"{dist.replace('-', '_')}_mod"
        (site / f"{mod}.py").write_text(textwrap.dedent(module_source))
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        eps = []
        for group, items in (("mpsrun.models", models), ("mpsrun.datasets", datasets), ("mpsrun.callbacks", callbacks)):
            if items:
                eps.append(f"[{group}]")
                eps += [f"{name} = {mod}:{attr}" for name, attr in items.items()]
        (info / "entry_points.txt").write_text("\n".join(eps) + "\n")
        monkeypatch.syspath_prepend(str(site))
        made.append(mod)
        _clear_plugin_cache()
        return site

    yield make
    for mod in made:
        sys.modules.pop(mod, None)
    _clear_plugin_cache()


def _clear_plugin_cache() -> None:
    from mpsrun.plugins import registry as plugins

    plugins.discover.cache_clear()
    importlib.invalidate_caches()


DIGITS = """\
device: cpu
epochs: 2
batch_size: 32
seed: 0
dataset:
  name: digits
model:
  name: {model}
optimizer:
  name: sgd
  lr: 0.05
tracking:
  experiment: plugtest
"""


def digits_recipe(work: "Workdir", model: str) -> Path:
    """A small offline recipe naming `model` with no model arguments."""
    return work.write("plug.yaml", DIGITS.format(model=model))


@pytest.fixture
def fashion_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small FashionMNIST in torchvision's real on-disk format (gzip'd IDX)."""
    from mpsrun.testing.idx import write_idx_dataset

    root = tmp_path_factory.mktemp("fm")
    write_idx_dataset(root, "FashionMNIST", n_train=640, n_test=128, seed=0)
    return root
