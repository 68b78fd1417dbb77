"""Start-up canaries: tested by injecting wrong results (there is no second device here).

Through the real CLI the canary only runs on non-CPU devices; `CPU_SELF_CHECK`
makes it run CPU against CPU, and `PERTURB` alters one operation's "device"
output, which is exactly what a broken backend would do.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpsrun.devices import canary

from .conftest import RECIPES

DIGITS = RECIPES / "digits_mlp.yaml"


@pytest.fixture
def self_check(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(canary, "CPU_SELF_CHECK", True)
    return monkeypatch


def _wrong(outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """What a broken kernel returns: the first output off by one (ints) or by 5% (floats)."""
    first = outs[0] * 1.05 if outs[0].is_floating_point() else outs[0] + 1
    return (first, *outs[1:])


def test_cpu_run_records_canary_skipped(work) -> None:
    r = work.cli("run", DIGITS, "epochs=1", "device=cpu", "-q")  # `auto` would take a GPU where there is one
    assert r.exit_code == 0, r.output
    tags = work.runs("digits_mlp")[0].data.tags
    assert tags["canary.status"] == "skipped (cpu)" and tags["canary.mode"] == "on"


def test_canary_passes_and_is_recorded(work, self_check) -> None:
    r = work.cli("run", DIGITS, "epochs=1", "-q")
    assert r.exit_code == 0, r.output
    tags = work.runs("digits_mlp")[0].data.tags
    assert tags["canary.status"] == "passed"
    assert set(tags["canary.ops"].split(",")) == set(canary.CHECKS) | {"model_forward"}
    assert 0 < float(tags["canary.time_s"]) < 5  # budget 1 s; loose here: 2 shared cores
    assert not any(k.startswith("canary.op.") for k in tags)


@pytest.mark.parametrize("op", ["argmax", "int64_sum", "model_forward"])
def test_injected_wrong_result_stops_the_run(work, self_check, op) -> None:
    self_check.setitem(canary.PERTURB, op, _wrong)
    r = work.cli("run", DIGITS, "epochs=1", "-q")
    assert r.exit_code == 1, r.output
    assert f"canary: 1 of {len(canary.CHECKS) + 1} operations" in r.stderr and op in r.stderr
    assert "canary: warn" in r.stderr  # says how to go on anyway
    run = work.runs("digits_mlp")[0]
    assert run.info.status == "FAILED"
    assert run.data.tags["canary.status"] == "failed"
    assert f"canary.op.{op}" in run.data.tags
    assert run.data.tags["mpsrun.error"].startswith("CanaryFailed")
    assert not work.history(run.info.run_id, "train_loss")  # stopped before training


def test_canary_warn_continues_and_records(work, self_check) -> None:
    self_check.setitem(canary.PERTURB, "argmax", _wrong)
    r = work.cli("run", DIGITS, "epochs=1", "canary=warn", "-q")
    assert r.exit_code == 0, r.output
    assert "canary (warn): 1 of" in r.stdout and "argmax" in r.stdout
    run = work.runs("digits_mlp")[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["canary.status"] == "warned" and "canary.op.argmax" in run.data.tags
    assert work.history(run.info.run_id, "train_loss")


def test_canary_off_skips(work, self_check) -> None:
    self_check.setitem(canary.PERTURB, "argmax", _wrong)
    r = work.cli("run", DIGITS, "epochs=1", "canary=off", "-q")
    assert r.exit_code == 0, r.output
    tags = work.runs("digits_mlp")[0].data.tags
    assert tags["canary.status"] == "off" and "canary.ops" not in tags


@pytest.fixture
def import_under_way(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """What a CUDA run's set-up meets: the thread importing torch._dynamo for the optimizer still busy
    (here a thread that waits until the test ends, so the timing cannot decide which path is taken)."""
    import threading

    from mpsrun.train import warm

    done = threading.Event()
    t = threading.Thread(target=done.wait, name="mpsrun-warm-dynamo", daemon=True)
    t.start()
    monkeypatch.setattr(warm, "_dynamo", t)
    yield t
    done.set()


def test_canary_runs_in_the_optimizers_import_wait_and_says_so(work, self_check, import_under_way) -> None:
    r = work.cli("run", DIGITS, "epochs=1", "device=auto", "-q")
    assert r.exit_code == 0, r.output
    tags = work.runs("digits_mlp")[0].data.tags
    assert tags["canary.status"] == "passed" and tags["canary.when"].startswith("during set-up")
    assert set(tags["canary.ops"].split(",")) == set(canary.CHECKS) | {"model_forward"}


def test_a_canary_failure_found_during_set_up_still_fails_the_run_before_training(work, self_check, import_under_way) -> None:
    self_check.setitem(canary.PERTURB, "model_forward", _wrong)
    r = work.cli("run", DIGITS, "epochs=1", "device=auto", "-q")
    assert r.exit_code == 1, r.output
    assert "model_forward" in r.stderr and "canary: warn" in r.stderr
    run = work.runs("digits_mlp")[0]
    assert run.info.status == "FAILED" and run.data.tags["canary.status"] == "failed"
    assert run.data.tags["canary.when"].startswith("during set-up") and "canary.op.model_forward" in run.data.tags
    assert not work.history(run.info.run_id, "train_loss")


def test_without_a_pending_import_the_canary_runs_just_before_training(work, self_check, monkeypatch) -> None:
    from mpsrun.train import warm

    monkeypatch.setattr(warm, "dynamo_pending", lambda: False)
    r = work.cli("run", DIGITS, "epochs=1", "device=auto", "-q")
    assert r.exit_code == 0, r.output
    tags = work.runs("digits_mlp")[0].data.tags
    assert tags["canary.status"] == "passed" and "canary.when" not in tags


def test_recipe_canary_words(work) -> None:
    """YAML 1.1 reads bare on/off as booleans; the recipe still means the words."""
    text = DIGITS.read_text() + "canary: off\n"
    r = work.cli("validate", work.write("c.yaml", text))
    assert r.exit_code == 0, r.output
    assert "canary: 'off'" in r.stdout or "canary: off" in r.stdout
    r = work.cli("validate", DIGITS, "canary=maybe")
    assert r.exit_code == 2 and "canary" in r.stderr


# ----------------------------------------------------------------------------- library level


@pytest.mark.parametrize("name", sorted(canary.CHECKS))
def test_each_check_agrees_and_catches_a_wrong_result(name, monkeypatch) -> None:
    check = canary.CHECKS[name]
    cpu = torch.device("cpu")
    assert canary.run_check(check, cpu).ok
    monkeypatch.setitem(canary.PERTURB, name, _wrong)
    res = canary.run_check(check, cpu)
    assert not res.ok and not res.unsupported and "output 1" in res.detail


def test_int64_check_catches_32_bit_arithmetic(monkeypatch) -> None:
    """The real failure mode: int64 values squeezed through int32."""
    monkeypatch.setitem(canary.PERTURB, "int64_sum", lambda outs: tuple(o.to(torch.int32).to(torch.int64) for o in outs))
    res = canary.run_check(canary.CHECKS["int64_sum"], torch.device("cpu"))
    assert not res.ok and "values differ" in res.detail


def test_an_op_that_raises_is_unsupported_not_wrong(self_check) -> None:
    calls = []

    def op(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        if len(calls) == 2:  # the "device" call
            raise RuntimeError("operator 'aten::cumsum.out' is not implemented for 'mps'")
        return x.cumsum(0)

    check = canary.Check("flaky", lambda g: (torch.arange(5),), op, "test")
    report = canary.run(torch.device("cpu"), "on", checks=[check])
    assert report.status == "passed" and not report.failures
    assert report.unsupported and "not implemented" in report.tags()["canary.unsupported"]


def test_model_forward_leaves_the_model_as_it_was() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 3)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = canary.model_forward(model, torch.randn(16, 4), torch.device("cpu"), lambda x: x)
    assert res.ok, res.detail
    assert all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_canary_runs_on_mps_mock(monkeypatch) -> None:
    """The MPS branch on Linux: device tensors are mocked (they stay on the CPU), synchronisation is counted."""
    syncs = []
    monkeypatch.setattr(canary, "_to", lambda t, device: t.clone())
    monkeypatch.setattr(torch.mps, "synchronize", lambda: syncs.append(1))
    mps = torch.device("mps")
    assert canary.applies(mps) and not canary.applies(torch.device("cpu"))
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4))
    report = canary.run(mps, "on", model, torch.randn(8, 1, 4, 4))
    assert report.status == "passed" and report.device == "mps"
    assert len(syncs) == 2  # before and after the timed checks
    assert report.tags()["canary.status"] == "passed"
    monkeypatch.setitem(canary.PERTURB, "argmax", _wrong)
    report = canary.run(mps, "on", model, torch.randn(8, 1, 4, 4))
    assert report.status == "failed" and "on mps differ from the CPU" in report.message()
    assert canary.run(mps, "warn").status == "warned"
    assert canary.run(mps, "off").status == "off"


def test_compare_is_normwise_and_nan_aware() -> None:
    ref = torch.tensor([10.0, 1e-9])
    assert not canary.compare(torch.tensor([10.0, 2e-9]), ref, 1e-5, 1e-4).exceeded
    assert canary.compare(torch.tensor([10.1, 1e-9]), ref, 1e-5, 1e-4).exceeded
    assert not canary.compare(torch.tensor([float("nan")]), torch.tensor([float("nan")]), 0, 0).exceeded
    assert canary.compare(torch.tensor([float("nan")]), torch.tensor([1.0]), 0, 0).exceeded


def test_strict_math_turns_tf32_and_autotuning_off_then_restores(monkeypatch) -> None:
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    monkeypatch.setattr(cudnn, "benchmark", True)
    monkeypatch.setattr(cudnn, "allow_tf32", True)
    with canary.strict_math():
        assert not cudnn.benchmark and not cudnn.allow_tf32 and not matmul.allow_tf32
    assert cudnn.benchmark and cudnn.allow_tf32


def test_a_sweep_worker_checks_the_fixed_operations_once_and_the_model_every_time(self_check, monkeypatch) -> None:
    """REUSE_OPS (set by sweep workers): the second run reuses the operations' results without running them again,
    still runs the model forward; an injected wrong result is never hidden by the reuse."""
    import torch.nn as nn

    monkeypatch.setattr(canary, "REUSE_OPS", True)
    monkeypatch.setattr(canary, "_OPS_DONE", {})
    model, probe, cpu = nn.Linear(4, 3), torch.randn(8, 4), torch.device("cpu")
    first = canary.run(cpu, "on", model, probe)
    calls: list[str] = []
    real = canary.run_check
    monkeypatch.setattr(canary, "run_check", lambda c, d: calls.append(c.name) or real(c, d))
    second = canary.run(cpu, "on", model, probe)
    assert second.status == first.status == "passed" and calls == []
    assert [r.name for r in second.results] == [r.name for r in first.results] and second.results[-1].name == "model_forward"
    name = next(iter(canary.CHECKS))
    monkeypatch.setitem(canary.PERTURB, name, _wrong)
    third = canary.run(cpu, "on", model, probe)
    assert third.status == "failed" and name in calls and [r.name for r in third.failures] == [name]


def test_a_slow_canary_is_flagged_only_where_it_was_on_the_runs_path() -> None:
    """Beside the torch._dynamo import the canary's wall time includes waits for the import's lock (seconds on
    the H100 machine), all inside a wait the run has anyway: not the run's cost, so no `canary.slow`."""
    ok = [canary.OpResult("argmax", True)]
    on_path = canary.Report("passed", "on", "cuda:0", 3.0, ok).tags()
    beside = canary.Report("passed", "on", "cuda:0", 3.0, ok, when="during set-up, while torch._dynamo was imported on a thread").tags()
    assert "canary.slow" in on_path and "canary.when" not in on_path
    assert "canary.slow" not in beside and beside["canary.when"].startswith("during set-up") and beside["canary.time_s"] == "3.0000"
