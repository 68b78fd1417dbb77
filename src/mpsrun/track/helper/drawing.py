"""The end-of-run figures with a drawer process: who draws what, and what happens when it cannot.

Why a module of its own: the drawer (`exporter.py --draw`) is an optimisation with a fallback, and a
fallback is said and tagged, never silent. The drawer draws the prediction figures the moment the
run asks, while the MLflow helper draws the learning curves and then writes the model; the helper
logs the drawer's files. A drawer that is gone before the ask, or fails while drawing, leaves every
figure to the helper (`hooks.end_figures`), with a note on the run. How they were drawn is the tag
`mpsrun.figures` (also where no drawer was started: too few cores, or not `mpsrun run`).
"""

from __future__ import annotations

from typing import Any, Callable

TAG = "mpsrun.figures"
BY_DRAWER = "drawn by a drawer process beside the MLflow helper (the learning curves by the helper)"


def by_helper(why: str) -> str:
    return f"drawn by the MLflow helper ({why})"


def start(tracker: Any, drawer: Any, why: str, args: tuple) -> Callable[[], list[str]]:
    """Start the figures for `hooks.end_figures`' arguments (history, title, predictions, classes); returns
    the call that waits for them and gives the notes. `tracker`: the BackgroundTracker (its helper hooks);
    `drawer`: its drawer process, or None (then `why` says why there is none)."""
    from mpsrun.track.helper.exporter import ExportAheadFailed

    if drawer is not None:
        try:
            drawer.draw((*args, False))  # all but the learning curves
        except ExportAheadFailed as e:
            drawer.close()
            why = f"the drawer process could not be asked: {e}"
            return _by_helper(tracker, args, why, [f"figures: {why}; drawn by the MLflow helper instead"])
        curves = tracker.later("curves", args[0], args[1])  # the helper's first work at the end

        def answer() -> list[str]:
            notes: list[str] = []
            try:
                curves()
            except Exception as e:  # noqa: BLE001
                notes.append(f"figures: learning curves not logged ({type(e).__name__}: {e})")
            try:  # the drawer's files are logged before `close` removes its folder
                drawn = drawer.figures_result()
                tracker.set_tags({TAG: BY_DRAWER})
                return notes + tracker.hook("log_drawn", drawn)
            except ExportAheadFailed as e:
                said = f"the drawer process could not serve: {e}"
                tracker.set_tags({TAG: by_helper(said)})
                return notes + [f"figures: {said}; drawn by the MLflow helper instead"] + tracker.hook("end_figures", *args)
            finally:
                drawer.close()

        return answer
    return _by_helper(tracker, args, why, [])


def _by_helper(tracker: Any, args: tuple, why: str, notes: list[str]) -> Callable[[], list[str]]:
    tracker.set_tags({TAG: by_helper(why)})
    later = tracker.later("end_figures", *args)
    return lambda: notes + later()
