"""Triton's cache key hashed on a thread while a CUDA run prepares (train/kernels/warm.py).

Real Triton (it ships with CUDA torch wheels; skipped where absent): the key is computed on the
named thread and cached where the first kernel launch reads it."""

from __future__ import annotations

import pytest


def test_triton_key_is_hashed_on_a_thread_and_cached_for_the_first_kernel() -> None:
    pytest.importorskip("triton")
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        from triton.compiler.compiler import triton_key  # type: ignore[no-redef]
    from mpsrun.train.kernels import warm

    triton_key.cache_clear()
    warm._thread = None
    warm.start()
    thread = warm._thread
    assert thread is not None and thread.name == "mpsrun-warm-triton"
    warm.start()  # once per process
    assert warm._thread is thread
    warm.wait()
    assert not thread.is_alive() and triton_key.cache_info().currsize == 1
    assert triton_key() and triton_key.cache_info().hits >= 1
