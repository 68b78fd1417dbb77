"""`mpsrun ui` looked at as a person would: a real headless Chromium (Debian's package,
driven by Playwright) on the run page of a finished digits run.

What the page must show is decided from the run itself (its parameters, its metric
history, its logged model, dataset inputs and figure artifacts), so the test follows the
run rather than a list of strings. Screenshots of each view land in the test's tmp folder
(kept by pytest under its basetemp) for a person to look at.

The same `mpsrun ui` is then checked as a process (the last test): it was started with no
flags in the folder `mpsrun run` wrote (./mlruns is the store browsed), said "starting..."
before its server answered and the experiment's link once it did, and a signal stops it, its
server and workers with it, and frees the port. Starting MLflow's server is most of either
check's time, so one server serves both (these were tests/test_ui_signals.py).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.proc_helpers import alive, descendants, port_free
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "digits_mlp.yaml"
FIGURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".svg", ".html")
PAGE_TIMEOUT_MS = 60_000


def chromium_path() -> str | None:
    """Debian's Chromium (apt-get install chromium); Playwright's own download cannot work offline."""
    for c in (os.environ.get("MPSRUN_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if c and os.access(c, os.X_OK):
            return c
    return None


def _why_no_browser() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    if chromium_path() is None:
        return "no Chromium at /usr/bin/chromium or on PATH (apt-get install chromium; .ci/run does it)"
    return None


pytestmark = pytest.mark.skipif(_why_no_browser() is not None, reason=f"no headless browser: {_why_no_browser()}")


@dataclass
class UiRun:
    url: str
    run_id: str
    experiment_id: str
    uri: str
    proc: subprocess.Popen
    lines: list[tuple[str, bool]]  # each line `mpsrun ui` printed, and whether its server answered when it came
    port: int
    stderr: Path

    def client(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    @property
    def page_url(self) -> str:
        return f"{self.url}/#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def artifacts(self) -> list[str]:
        c, out, todo = self.client(), [], [None]
        while todo:
            for f in c.list_artifacts(self.run_id, todo.pop()):
                (todo.append(f.path) if f.is_dir else out.append(f.path))
        return sorted(out)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=15) as r:
            return r.status == 200
    except OSError:
        return False


def _experiment_exists(db: Path, name: str) -> bool:
    """Read straight from the SQLite file: no MLflow import, no schema work under the run's feet."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return con.execute("SELECT 1 FROM experiments WHERE name = ?", (name,)).fetchone() is not None
    except sqlite3.Error:
        return False


@pytest.fixture(scope="module")
def ui_run(tmp_path_factory: pytest.TempPathFactory, template_db: Path):
    """A finished digits run in the default store (./mlruns), browsed by `mpsrun ui` with no flags on a free port.

    The UI starts as soon as the run has made its experiment (so the link `mpsrun ui` prints
    names it) and starts its server while the run trains (the store is a copy of the migrated
    template, so neither creates the schema under the other).
    """
    work = tmp_path_factory.mktemp("ui")
    (work / "mlruns").mkdir()
    db = work / "mlruns" / "mlflow.db"
    shutil.copy(template_db, db)
    uri = f"sqlite:///{db}"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.setdefault("OMP_NUM_THREADS", "1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    train = subprocess.Popen(
        [sys.executable, "-m", "mpsrun", "run", str(RECIPE), "epochs=3", "device=cpu", "-q"],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while not _experiment_exists(db, "digits_mlp"):
        assert train.poll() is None or _experiment_exists(db, "digits_mlp"), train.communicate()
        assert time.monotonic() < deadline, "the run made no experiment in 120 s"
        time.sleep(0.1)
    with open(work / "ui.err", "w") as errlog:  # a file, not a pipe: nobody reads the server's log while it serves
        ui = subprocess.Popen(
            [sys.executable, "-m", "mpsrun", "ui", "--port", str(port)],  # no flags: ./mlruns
            cwd=work, env=env, stdout=subprocess.PIPE, stderr=errlog, text=True, start_new_session=True,
        )
    lines: list[tuple[str, bool]] = []

    def read() -> None:
        for line in ui.stdout:  # type: ignore[union-attr]
            lines.append((line.rstrip("\n"), _answers(url)))

    threading.Thread(target=read, daemon=True).start()
    try:
        out, err = train.communicate(timeout=300)
        assert train.returncode == 0, out + err
        run_id = re.search(r"\brun ([0-9a-f]{32})\b", out).group(1)  # type: ignore[union-attr]
        deadline = time.monotonic() + 120
        while not _answers(url):
            assert ui.poll() is None, f"mpsrun ui exited {ui.returncode}:\n{lines}\n{(work / 'ui.err').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"mpsrun ui not up in 120 s:\n{lines}"
            time.sleep(0.5)
        from mlflow.tracking import MlflowClient

        exp_id = MlflowClient(tracking_uri=uri).get_run(run_id).info.experiment_id
        yield UiRun(url, run_id, exp_id, uri, ui, lines, port, work / "ui.err")
    finally:
        if train.poll() is None:
            train.kill()
        _stop(ui)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=["--headless", "--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def run_page(browser, ui_run: UiRun):
    """The run's page, loaded once (a load is seconds of the server's time); tests move between its tabs."""
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    pg.set_default_timeout(PAGE_TIMEOUT_MS)
    pg.goto(ui_run.page_url)
    yield pg
    pg.close()


@pytest.fixture
def page(run_page, ui_run: UiRun, tmp_path: Path):
    """The run page on its Overview tab; a screenshot of wherever the test left it, whatever happened."""
    if run_page.url != ui_run.page_url:
        run_page.goto(ui_run.page_url)  # another tab of the same page: the app routes, nothing reloads
    run_page.get_by_text(re.compile(r"^Parameters \(\d+\)$")).first.wait_for()
    yield run_page
    run_page.screenshot(path=str(tmp_path / "last.png"), full_page=True)


def test_run_page_shows_the_parameters(page, ui_run: UiRun, tmp_path: Path) -> None:
    params = ui_run.client().get_run(ui_run.run_id).data.params
    assert params["optimizer.lr"] == "0.003" and params["epochs"] == "3"
    heading = page.get_by_text(re.compile(r"^Parameters \(\d+\)$")).first.inner_text()
    assert heading == f"Parameters ({len(params)})"
    for key in ("optimizer.lr", "epochs", "model.name", "dataset.name"):
        row = page.get_by_role("row").filter(has=page.get_by_role("cell").get_by_text(key, exact=True))
        assert row.count() >= 1, f"parameter {key} not on the page"
        assert params[key] in row.first.inner_text()
    assert page.get_by_text(ui_run.run_id, exact=True).count() >= 1, "the run id is not on its page"
    assert page.get_by_text("Finished", exact=True).count() >= 1, "the run's status is not shown"
    page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)


def _shown(page, names: list[str], headings: str) -> list[str]:
    """Section headings and chart titles among `names`, in the order the page shows them (it draws more as it scrolls)."""
    return page.evaluate(
        """([names, headings]) => Array.from(document.querySelectorAll('body *'))
             .filter(e => e.children.length === 0 && (names.includes(e.textContent.trim()) || new RegExp(headings).test(e.textContent.trim())))
             .map(e => e.textContent.trim())""",
        [names, headings],
    )


def test_model_metrics_tab_opens_with_the_users_training_metrics(page, ui_run: UiRun, tmp_path: Path) -> None:
    """The tab's first section and first charts are the run's training metrics, not mpsrun's measurements.

    MLflow's UI sorts charts by name and puts every "prefix/" section before the unprefixed
    "Model metrics" one, except "system/", which has a tab of its own: mpsrun's times, throughput
    and memory (per epoch and per run) are `system/...` and drawn there (track/records/names.py);
    its bookkeeping sits in mpsrun_timings.json; the `final_*` copies of the last epoch are not logged.
    """
    metrics = ui_run.client().get_run(ui_run.run_id).data.metrics
    training = sorted(k for k in metrics if "/" not in k)  # what the run's Model metrics tab draws
    assert training == ["lr", "train_loss", "val_accuracy", "val_loss"], training
    measured = ["epoch_time_s", "train_time_s", "val_time_s", "train_samples_per_s", "memory_bytes",
                "first_epoch_time_s", "steady_epoch_time_s", "total_train_time_s", "steady_train_samples_per_s", "peak_memory_bytes"]
    assert {f"system/{k}" for k in measured} <= set(metrics) and not [k for k in metrics if "/" in k and not k.startswith("system/")]
    page.get_by_text("Model metrics", exact=True).first.click()
    page.get_by_placeholder(re.compile("Search metric charts", re.I)).fill("")
    page.locator(".js-plotly-plot").first.wait_for()
    page.get_by_text(re.compile(rf"^Model metrics\s*\({len(training)}\)$")).first.wait_for()  # the section holds every one, the losses included
    page.locator(".js-plotly-plot").nth(len(training) - 1).wait_for()
    shown = _shown(page, [*training, *measured, "best_epoch", "final_val_loss"], r"^(Model metrics|System metrics|mpsrun|system)")
    charts = [t for t in shown if t in training]
    assert not set(measured) & set(shown) and "final_val_loss" not in shown and "mpsrun" not in shown, shown
    assert charts == training, shown  # the first screen: all of them, in MLflow's order, under...
    assert shown[shown.index(charts[0]) - 1] == "Model metrics", shown  # ...the first section's heading
    page.screenshot(path=str(tmp_path / "model_metrics_first_screen.png"))
    if os.environ.get("MPSRUN_UI_SHOTS"):  # a folder to keep the screenshots in, to look at by eye
        page.screenshot(path=str(Path(os.environ["MPSRUN_UI_SHOTS"]) / "model_metrics_first_screen.png"))
    # mpsrun's measurements are on the System metrics tab, one chart each, beside MLflow's samples
    page.get_by_text("System metrics", exact=True).first.click()
    page.get_by_placeholder(re.compile("Search metric charts", re.I)).fill("epoch_time_s")
    page.get_by_text("epoch_time_s", exact=True).first.wait_for()
    page.get_by_text("first_epoch_time_s", exact=True).first.wait_for()
    page.get_by_text("steady_epoch_time_s", exact=True).first.wait_for()
    page.get_by_placeholder(re.compile("Search metric charts", re.I)).fill("")
    if os.environ.get("MPSRUN_UI_SHOTS"):
        page.screenshot(path=str(Path(os.environ["MPSRUN_UI_SHOTS"]) / "system_metrics.png"))


def test_model_metrics_tab_draws_the_val_loss_curve(page, ui_run: UiRun, tmp_path: Path) -> None:
    history = ui_run.client().get_metric_history(ui_run.run_id, "val_loss")
    assert [m.step for m in history] == [0, 1, 2]
    page.get_by_text("Model metrics", exact=True).first.click()
    page.get_by_placeholder(re.compile("Search metric charts", re.I)).fill("val_loss")
    # a line chart of the history: the legend names the run and metric; the card, titled
    # val_loss, holds a plotly plot with a drawn line over a "Step" axis
    legend = page.get_by_text(re.compile(r"\(val_loss\)$")).first
    legend.wait_for()
    card = legend.locator("xpath=ancestor::div[.//*[normalize-space(text())='val_loss']][1]")
    card.locator(".js-plotly-plot path.js-line").first.wait_for()
    assert card.locator(".js-plotly-plot").count() == 1
    assert "Step" in card.inner_text()
    page.screenshot(path=str(tmp_path / "model_metrics.png"), full_page=True)


def test_run_page_shows_the_logged_model_and_the_dataset(page, ui_run: UiRun, tmp_path: Path) -> None:
    c = ui_run.client()
    models = c.search_logged_models(experiment_ids=[ui_run.experiment_id], filter_string=f"source_run_id = '{ui_run.run_id}'")
    datasets = c.get_run(ui_run.run_id).inputs.dataset_inputs
    assert [m.name for m in models] == ["model"], "the run logged no model"
    assert {d.dataset.name for d in datasets} == {"digits"}, "the run has no dataset inputs"
    assert page.get_by_text(re.compile(r"^Logged models")).count() >= 1
    for m in models:  # each logged model is linked from the run page
        page.locator(f"a[href$='/models/{m.model_id}']").first.wait_for()
    # the first dataset by name and digest, e.g. "digits (55c3a172)", then "+N" for the others
    shown = "|".join(f"{re.escape(d.dataset.name)} \\({re.escape(d.dataset.digest[:8])}" for d in datasets)
    page.get_by_text(re.compile(rf"^({shown})")).first.wait_for()
    if len(datasets) > 1:
        assert page.get_by_text(f"+{len(datasets) - 1}", exact=True).count() >= 1
    page.screenshot(path=str(tmp_path / "model_and_dataset.png"), full_page=True)


def test_artifacts_tab_lists_the_figures(page, ui_run: UiRun, tmp_path: Path) -> None:
    artifacts = ui_run.artifacts()
    figures = [a for a in artifacts if a.lower().endswith(FIGURE_SUFFIXES)]
    assert len(figures) >= 2, f"fewer than two figures among the run's artifacts {artifacts}"
    page.get_by_text("Artifacts", exact=True).first.click()
    page.get_by_text("recipe.yaml", exact=True).first.wait_for()
    for fig in figures:
        *folders, name = fig.split("/")
        for folder in folders:  # the tree starts collapsed
            node = page.get_by_text(folder, exact=True).first
            if not page.get_by_text(name, exact=True).count():
                node.click()
        page.get_by_text(name, exact=True).first.wait_for()
    # a figure opens as an image in the preview pane
    page.get_by_text(figures[0].split("/")[-1], exact=True).first.click()
    if figures[0].lower().endswith((".png", ".jpg", ".jpeg")):
        page.locator("img[src^='blob:']").first.wait_for()  # the preview loads the file into a blob
    page.screenshot(path=str(tmp_path / "artifacts.png"), full_page=True)


def test_ui_said_starting_then_the_link_and_a_signal_stops_its_server_and_frees_the_port(ui_run: UiRun) -> None:
    """Last, on the same `mpsrun ui`: SIGTERM (what `docker stop` and Slurm send; SIGINT, 130, takes
    the same path) stops mpsrun, the MLflow server it started and its workers; exit 143, port freed."""
    proc, lines = ui_run.proc, ui_run.lines
    said = lambda: [x for x in lines if x[0].startswith("MLflow UI: ")]  # noqa: E731  (the server's own lines interleave)
    deadline = time.monotonic() + 30
    while not said() and time.monotonic() < deadline:
        time.sleep(0.1)
    # "starting..." at once, before the server answers; the link only once it does, to the experiment's runs
    assert lines and lines[0][0].startswith("starting the MLflow UI") and not lines[0][1], lines
    assert "mlruns/mlflow.db" in lines[0][0], lines  # no flags: the store `mpsrun run` wrote in this folder
    ((text, answered),) = said()
    assert f"{ui_run.url}/#/experiments/{ui_run.experiment_id}/runs" in text and answered, lines
    tree = descendants(proc.pid)
    assert tree, "the server should run as a child of mpsrun ui"
    assert not port_free(ui_run.port)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # only mpsrun itself: it must pass the signal on
    proc.wait(timeout=60)
    err = ui_run.stderr.read_text()
    assert proc.returncode == 143, "\n".join(x for x, _ in lines) + err
    assert time.monotonic() - t < 30
    deadline = time.monotonic() + 10
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tree if alive(p)], "orphaned server processes"
    assert port_free(ui_run.port)
    assert "Traceback" not in err
