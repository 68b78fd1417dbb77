"""The `mpsrun` command: parses, calls, prints, sets exit codes. Nothing else.

One module per group of commands; each registers on the shared Typer `app`.
"""

from __future__ import annotations

import os
import sys

from mpsrun.cli import run, sweep, plugins, devices, bench, resume, sync  # noqa: F401,I001  (registers the commands, in --help order)
from mpsrun.cli import eval as _eval  # noqa: F401,E402  (registers `mpsrun eval`)
from mpsrun.cli import common
from mpsrun.cli.common import EXIT_INTERRUPT, app, err

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point; maps a stray Ctrl-C to exit 130.

    A rank of a data-parallel job (`--nproc`, `torchrun`) ends through
    `train.teardown.finish`: in step with the other ranks and without Python's
    finalisation, which gloo's worker threads do not survive (see that module).
    """
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    code: int = 0
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        code = EXIT_INTERRUPT
        raise SystemExit(EXIT_INTERRUPT) from None
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    except BaseException:
        code = 1
        if _rank_of_a_job():
            import traceback

            traceback.print_exc()  # the process ends with os._exit below: Python would not print it
        raise
    finally:
        if _rank_of_a_job():
            from mpsrun.train.ranks import teardown

            teardown.finish(code)  # never returns
        if common.END_WITHOUT_FINALISATION:
            _end(code)  # never returns


def _end(code: int) -> None:
    """End `mpsrun run` without Python's module-by-module teardown of torch (over a second on 2 cores).

    Only once the run's command is over: every record is written (the MLflow helper has answered
    `finish`), so what is skipped is freeing memory the operating system frees anyway. `atexit`
    handlers still run (weakref finalizers, temporary folders, logging), streams are flushed.
    """
    import atexit

    _drop_silent_exit_work(atexit)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _drop_silent_exit_work(atexit) -> None:  # type: ignore[no-untyped-def]
    """Unregister exit handlers whose only output no one would see.

    torch._dynamo (imported by every torch optimizer) registers `dump_compile_times`, which builds a
    table of compile times and logs it at INFO on its logger, hidden unless the user turned torch's
    logs on (TORCH_LOGS). Building it took 0.11 s of the fashion run's exit on the H100 machine (a
    py-spy profile: its `tabulate`), for nothing shown. Kept where that logger would print it.
    """
    import logging

    utils = sys.modules.get("torch._dynamo.utils")
    dump = getattr(utils, "dump_compile_times", None)
    log = getattr(utils, "log", None)
    if dump is not None and isinstance(log, logging.Logger) and not log.isEnabledFor(logging.INFO):
        atexit.unregister(dump)


def _rank_of_a_job() -> bool:
    if "mpsrun.train.ranks.distributed" not in sys.modules:  # never imports torch for --help, validate, ...
        return False
    from mpsrun.train.ranks import teardown

    return teardown.active()
