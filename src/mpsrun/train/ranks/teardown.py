"""How a rank of a data-parallel job ends: in step with the others, and without Python's finalisation.

Why this exists (the `terminate called without an active exception` flake). gloo runs
every collective on its own C++ worker threads (`pt_gloo_runloop`). After a collective
completes, its worker still releases what the collective held; when that is a Python
object (a tensor whose Python wrapper the main thread already dropped, a Python future
callback) the worker has to take the GIL. Once CPython has begun finalising the
interpreter, a foreign thread that asks for the GIL is ended with `pthread_exit`; the
forced unwind meets a C++ destructor (`noexcept`) and the C++ runtime calls
`std::terminate`: SIGABRT, the rank exits -6 after a job that had succeeded, and the
launcher fails the job. Nothing joins those workers first: once DDP is built, its
reducer keeps the process group alive, so `destroy_process_group()` (at `atexit`) does
not destroy it and its threads run on into finalisation. The rank that finishes first
(every rank but 0: rank 0 goes on to log figures and the model) is the one exposed,
and a busy machine (a late worker) makes it likely.

So a rank of a job ends here, from the CLI's entry point, once its command is done:
1. on success, every rank waits until all ranks are done (a key per rank in the job's
   store, not a gloo collective), so none leaves while another may still need it
   (rank 0 hosts the store that `--nproc` and `torchrun --standalone` jobs use);
2. it leaves the process group, joins its own non-daemon threads and runs the `atexit`
   handlers (MLflow's included) with the interpreter fully alive, as a normal exit does;
3. it flushes stdout and stderr and ends the process with `os._exit(code)`: no
   finalisation, so no worker thread is ever asked to die while it holds the GIL's
   promise. The operating system closes sockets and files.

A single process never comes here: `active()` is False unless `distributed.init` ran.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from mpsrun.train.ranks import distributed

DONE_KEY = "mpsrun/done/"
ENV_DONE_WAIT = "MPSRUN_DIST_DONE_WAIT_S"  # how long a finished rank waits for the others (rank 0 logs the model meanwhile)


def active() -> bool:
    """True in a process that joined a job's process group (a rank of `--nproc` or `torchrun`)."""
    return distributed.joined()


def finish(code: int) -> None:
    """End this rank's process with `code` (see the module docstring); never returns."""
    try:
        mark_done(code)
        if code == 0:
            wait_for_peers()
        distributed.shutdown()
        _join_threads()
        atexit._run_exitfuncs()  # MLflow's, logging's, tempfile's: while the interpreter is whole
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def mark_done(code: int) -> None:
    """Say in the job's store that this rank's command ended (with `code`): no peer waits for it then."""
    ctx, store = distributed.context(), distributed.job_store()
    if ctx is None or store is None:
        return
    try:
        store.set(f"{DONE_KEY}{ctx.rank}", str(code))
    except Exception:
        pass  # the store is gone with rank 0: nobody is left to wait


def wait_for_peers(timeout_s: float | None = None) -> bool:
    """Wait until every rank marked itself done; False on a timeout, a store that went away or a signal.

    Polled (`check`, every 0.1 s) rather than one blocking `wait`, so a signal from the
    launcher still reaches Python. None of these is an error for a rank whose own work
    succeeded: it goes on to exit 0, and the launcher names the rank that failed.
    """
    ctx, store = distributed.context(), distributed.job_store()
    if ctx is None or store is None:
        return False
    keys = [f"{DONE_KEY}{r}" for r in range(ctx.world_size)]
    deadline = time.monotonic() + (float(os.environ.get(ENV_DONE_WAIT, "3600")) if timeout_s is None else timeout_s)
    try:
        while not store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True
    except BaseException:  # noqa: BLE001 - a store gone with rank 0, or the launcher's SIGTERM: leave anyway
        return False


def _join_threads() -> None:
    """What `threading._shutdown` does before `atexit`: non-daemon threads finish their work."""
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon and t.is_alive():
            t.join()
