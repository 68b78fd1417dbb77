"""The documentation's pictures, taken from the real thing: `mpsrun ui` in a headless Chromium.

A digits run, a digits sweep and a small bench write one store; `mpsrun ui` serves it; Playwright
(Debian's Chromium, as tests/test_ui_browser.py) opens the run's Model and System metrics tabs, the
sweep parent's optimization history and the bench parent's comparison chart, checks each shows what
it should, and writes the screenshots the guides show into the folder named by MPSRUN_DOCS_SHOTS:

    MPSRUN_DOCS_SHOTS=docs/images .venv/bin/python -m pytest -q tests/test_docs_shots.py

Only then: CI does not set it, so the suite neither spends the minute this takes nor dirties the
tree; tests/test_ui_browser.py checks the same UI on every run, and tests/test_docs.py checks the
committed pictures are in the built site.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.servers import free_port
from tests.test_ui_browser import _answers, _stop, _why_no_browser, chromium_path

ROOT = Path(__file__).resolve().parents[1]
SHOTS = os.environ.get("MPSRUN_DOCS_SHOTS")
PAGE_TIMEOUT_MS = 60_000

pytestmark = [
    pytest.mark.skipif(not SHOTS, reason="set MPSRUN_DOCS_SHOTS=docs/images to retake the documentation's pictures"),
    pytest.mark.skipif(_why_no_browser() is not None, reason=f"no headless browser: {_why_no_browser()}"),
]

BENCH = """\
device: cpu
epochs: 3
batch_size: 64
seed: 0
dataset: {name: digits, val_fraction: 0.2}
model: {name: mlp, hidden: [64]}
optimizer: {name: adam, lr: 0.003}
tracking: {experiment: digits_bench, log_model: false}
matrix:
  device: [cpu]
  model.hidden: [[64], [256, 256]]
  batch_size: [32, 128]
"""


def _mpsrun(work: Path, *args: str, timeout: int = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.setdefault("OMP_NUM_THREADS", "1")
    r = subprocess.run([sys.executable, "-m", "mpsrun", *args], cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"mpsrun {' '.join(args)}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, template_db: Path):
    """One store holding a run, a sweep and a bench, and `mpsrun ui` on it."""
    work = tmp_path_factory.mktemp("shots")
    (work / "mlruns").mkdir()
    shutil.copy(template_db, work / "mlruns" / "mlflow.db")
    out = _mpsrun(work, "run", str(ROOT / "recipes" / "digits_mlp.yaml"), "epochs=12", "device=cpu", "-q")
    run_id = re.search(r"\brun ([0-9a-f]{32})\b", out).group(1)  # type: ignore[union-attr]
    _mpsrun(work, "sweep", str(ROOT / "recipes" / "digits_sweep.yaml"), "device=cpu", "--trials", "8")
    (work / "bench.yaml").write_text(BENCH)
    _mpsrun(work, "bench", "bench.yaml")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(work / "ui.err", "w") as errlog:
        ui = subprocess.Popen([sys.executable, "-m", "mpsrun", "ui", "--port", str(port)], cwd=work,
                              stdout=subprocess.DEVNULL, stderr=errlog, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _answers(url):
            assert ui.poll() is None and time.monotonic() < deadline, (work / "ui.err").read_text()[-3000:]
            time.sleep(0.5)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlruns' / 'mlflow.db'}")
        yield url, client, run_id
    finally:
        _stop(ui)


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=["--headless", "--no-sandbox"])
        pg = b.new_page(viewport={"width": 1440, "height": 900})
        pg.set_default_timeout(PAGE_TIMEOUT_MS)
        yield pg
        b.close()


def _close_assistant(page) -> None:
    """MLflow 3 opens its assistant panel beside every page; the pictures are of the run, so close it."""
    for button in page.get_by_role("button", name="Close", exact=True).all():
        box = button.bounding_box()
        if box and box["x"] > page.viewport_size["width"] * 0.6:  # the panel's header, top right
            button.click(timeout=5_000)
            page.wait_for_timeout(500)
            return


def _save(page, name: str) -> None:
    folder = Path(SHOTS)  # type: ignore[arg-type]
    folder.mkdir(parents=True, exist_ok=True)
    _close_assistant(page)
    page.screenshot(path=str(folder / name))
    assert (folder / name).stat().st_size > 10_000


def _parent(client, experiment: str) -> tuple[str, str]:
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], order_by=["attribute.start_time ASC"])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    return exp.experiment_id, parent.info.run_id


def _open_artifact(page, url: str, exp_id: str, run_id: str, folders: list[str], name: str) -> None:
    page.goto(f"{url}/#/experiments/{exp_id}/runs/{run_id}/artifacts")
    for folder in folders:
        page.get_by_text(folder, exact=True).first.click()
    page.get_by_text(name, exact=True).first.click()
    page.locator("img[src^='blob:']").first.wait_for()  # the preview loads the file into a blob
    page.wait_for_timeout(500)


def test_run_page_training_and_system_charts(store, page) -> None:
    url, client, run_id = store
    exp_id = client.get_run(run_id).info.experiment_id
    page.goto(f"{url}/#/experiments/{exp_id}/runs/{run_id}/model-metrics")
    page.get_by_text("Model metrics", exact=True).first.wait_for()
    page.locator(".js-plotly-plot path.js-line").nth(3).wait_for()  # lr, train_loss, val_accuracy, val_loss drawn
    page.wait_for_timeout(1000)
    _save(page, "run_model_metrics.png")
    page.get_by_text("System metrics", exact=True).first.click()
    page.get_by_placeholder(re.compile("Search metric charts", re.I)).fill("epoch_time_s")
    page.get_by_text("steady_epoch_time_s", exact=True).first.wait_for()
    page.wait_for_timeout(1000)
    _save(page, "run_system_metrics.png")


def test_sweep_parent_figures(store, page) -> None:
    url, client, _ = store
    exp_id, parent = _parent(client, "digits_sweep")
    names = [a.path for a in client.list_artifacts(parent, "figures")]
    assert "figures/optimization_history.png" in names, names
    _open_artifact(page, url, exp_id, parent, ["figures"], "optimization_history.png")
    _save(page, "sweep_figures.png")


def test_bench_parent_comparison_table(store, page) -> None:
    url, client, _ = store
    exp_id, parent = _parent(client, "digits_bench")
    names = {a.path for a in client.list_artifacts(parent)}
    assert {"results.png", "results.md"} <= names, names
    _open_artifact(page, url, exp_id, parent, [], "results.png")
    _save(page, "bench_table.png")


