"""The per-shape checks of a fused group's own kernels (sweep/fused/kernels/checked.py): collected by one step,
then run side by side, a failure said once. CPU: the bookkeeping and the threads are the same there; the
kernels' own checks are tests/test_fused_tconv.py's."""

from __future__ import annotations

import threading

import pytest
import torch

from mpsrun.sweep.fused.kernels import checked, convcheck

CPU = torch.device("cpu")


def test_checks_collected_while_discovering_run_side_by_side_and_a_failure_is_said_once() -> None:
    said: list[str] = []
    a, b = convcheck.Convs(said.append), convcheck.Convs(said.append)
    together = threading.Barrier(3, timeout=20)  # three checks that pass only if they run at the same time
    ran: list[str] = []

    def meet(name: str, fail: BaseException | None = None):
        def run() -> None:
            together.wait()
            ran.append(name)
            if fail is not None:
                raise fail
        return run

    with checked.discovering([a, b]):
        assert a.ready(("k1",), meet("a1"), False) is False  # collected, not run: the library's op meanwhile
        assert a.ready(("k1",), meet("again"), False) is False  # once a shape
        assert not b.ready(("k2",), meet("b2", convcheck.Mismatch("conv grouped: the output is 0.5 from cuDNN's")), False)
        assert not b.ready(("k3",), meet("b3", RuntimeError("out of resource: shared memory\nmore")), False)
    assert ran == [] and len(a.pending) == 1 and len(b.pending) == 2
    assert checked.run_pending([a, b], CPU) == 3
    assert sorted(ran) == ["a1", "b2", "b3"]
    assert a.ready(("k1",), meet("never"), False) is True and a.off is None  # passed: no check again
    assert b.off is not None and b.ready(("k4",), meet("never"), False) is False  # given up for the group
    assert len(said) == 1 and said[0].startswith("convolutions: cuDNN's for this group")
    assert ("the output is 0.5" in said[0]) != ("RuntimeError: out of resource: shared memory)" in said[0])  # the first failure taken
    assert a.pending == {} and b.pending == {}


def test_a_check_outside_discovery_runs_at_once_and_a_kernel_that_cannot_be_built_is_brief() -> None:
    said: list[str] = []
    c = convcheck.Convs(said.append)
    calls: list[int] = []
    assert c.ready(("k",), lambda: calls.append(1), False) is True and calls == [1]

    def cannot() -> None:
        raise RuntimeError("out of resource: shared memory, Required: 263168\nthe rest")

    assert c.ready(("other",), cannot, False) is False
    assert said == ["convolutions: cuDNN's for this group, not the fused Triton kernels (RuntimeError: out of resource: shared memory, Required: 263168)"]


def test_kernels_that_cannot_be_defined_give_every_owner_up(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    c = convcheck.Convs(said.append)
    with checked.discovering([c]):
        c.ready(("k",), lambda: None, False)

    def broken() -> None:
        raise ImportError("no triton")

    assert checked.run_pending([c], CPU, broken) == 0
    assert c.off == "ImportError: no triton" and len(said) == 1


def test_discovery_turns_cudnn_time_trials_off_and_back() -> None:
    was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        with checked.discovering([]):
            assert torch.backends.cudnn.benchmark is False
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = was


def test_an_owner_whose_shapes_share_kernels_checks_them_in_turn_on_one_thread() -> None:
    """FastPools and the SGD kernel: every shape compiles the same kernels, so their checks run one after another on
    one thread (the first compiles, the rest find them built), beside the other owners' threads."""
    said: list[str] = []
    pools = checked.Checked(said.append)
    pools.together = False
    seen: list[tuple[str, int]] = []
    with checked.discovering([pools]):
        for name in ("p1", "p2", "p3"):
            pools.ready((name,), lambda name=name: seen.append((name, threading.get_ident())), False)
    assert checked.run_pending([pools], CPU) == 1  # one thread for the three
    assert [n for n, _ in seen] == ["p1", "p2", "p3"] and len({t for _, t in seen}) == 1
    assert pools.checked == {("p1",), ("p2",), ("p3",)} and said == []
