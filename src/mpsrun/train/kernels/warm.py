"""Triton's cache key, computed on a thread while a CUDA run sets up.

Why: the first Triton kernel a process launches computes `triton_key()`, a SHA-256 of Triton's
sources and of its 500 MB `libtriton.so`, even when every kernel comes from the on-disk cache:
0.4 s of the fashion run's first epoch on the H100 machine (a py-spy profile, issue 27 item 2).
Reading the file and hashing it release the interpreter lock, so on a thread started as the run
prepares (data, model, canary) it costs the run nothing, where the first epoch waited for it.
The answer is cached by Triton (`functools.lru_cache`); `wait()` before the first kernel keeps
the training thread from computing it a second time beside the thread.
"""

from __future__ import annotations

import threading

_thread: threading.Thread | None = None


def start() -> None:
    """Begin computing the key (once per process; nothing where Triton is not importable)."""
    global _thread
    if _thread is not None:
        return

    def work() -> None:
        try:
            try:
                from triton.runtime.cache import triton_key
            except ImportError:  # older Triton kept it beside the compiler
                from triton.compiler.compiler import triton_key  # type: ignore[no-redef]
            triton_key()
        except Exception:  # noqa: BLE001 - the first kernel computes it (or meets the error) as it would have
            pass

    _thread = threading.Thread(target=work, name="mpsrun-warm-triton", daemon=True)
    _thread.start()


def wait() -> None:
    """Until the key is known (at once where `start` was not called)."""
    if _thread is not None:
        _thread.join()
