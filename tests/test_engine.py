"""The engine's speed promises, checked on what it actually does.

- no host synchronisation inside the step loop: `.item()` (aten._local_scalar_dense)
  is counted by a dispatch mode during real training;
- CUDA graphs replay exactly the eager computation (run where CUDA exists; the
  lead runs these on the GPU machine, CI skips them visibly);
- resident batching visits every sample once per epoch, in a seeded order.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpsrun.train.loop import engine

from mpsrun.train import runner
from mpsrun.train.loop.data import ResidentBatches
from mpsrun.plugins import resolve

from .conftest import RECIPES


class CountItems(TorchDispatchMode):
    """Counts device->host scalar reads, the syncs that stall a GPU pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _setup(*overrides: str) -> runner.Setup:
    return runner.prepare(resolve(RECIPES / "digits_mlp.yaml", ["device=cpu", *overrides]))


def _train(setup: runner.Setup, listener: engine.Listener | None = None) -> engine.TrainResult:
    r = setup.resolved.recipe
    return engine.train(
        setup.model, setup.optimizer, setup.plan, setup.choice.device, r.epochs, setup.options,
        listener or engine.Listener(),
    )


def test_no_host_sync_inside_the_step_loop() -> None:
    # SGD: Adam reads its CPU-side step counter with .item() by design (no device sync),
    # which would blur what this test measures: the engine's own reads.
    setup = _setup("epochs=3", "batch_size=16", "optimizer.name=sgd")
    steps = len(setup.plan.train)
    assert steps > 50
    with CountItems() as counter:
        _train(setup)
    # per epoch: train loss, val loss, val correct count; nothing per step
    assert counter.n == 3 * 3


def test_log_every_reads_loss_at_that_interval_only() -> None:
    setup = _setup("epochs=1", "batch_size=16", "log_every=20", "optimizer.name=sgd")
    steps = len(setup.plan.train)
    seen: list[float] = []

    class Grab(engine.Listener):
        def on_step(self, epoch, step, samples, loss):  # type: ignore[no-untyped-def]
            if loss is not None:
                seen.append(loss)

    with CountItems() as counter:
        _train(setup, Grab())
    assert len(seen) == steps // 20
    assert counter.n == 3 + steps // 20


def test_resident_batches_cover_every_sample_once_in_seeded_order() -> None:
    x = torch.arange(100).view(100, 1)
    y = torch.arange(100)
    a = ResidentBatches(x, y, 32, torch.device("cpu"), True, 7)
    b = ResidentBatches(x, y, 32, torch.device("cpu"), True, 7)
    ea = torch.cat([yb for _, yb in a])
    assert sorted(ea.tolist()) == list(range(100))
    assert ea.tolist() == torch.cat([yb for _, yb in b]).tolist(), "same seed, same order"
    assert ea.tolist() != torch.cat([yb for _, yb in a]).tolist(), "a new order each epoch"
    assert [len(yb) for _, yb in a] == [32, 32, 32, 4]


@pytest.mark.parametrize("resident", ["true", "false"])
def test_model_sees_each_input_transformed_exactly_once(resident: str) -> None:
    """digits pixels are 0..16 and the transform divides by 16: the model must see max 1.0."""
    setup = _setup("epochs=1", f"resident={resident}")
    maxes: list[float] = []
    setup.model.register_forward_pre_hook(lambda m, a: maxes.append(float(a[0].max())))
    _train(setup)
    assert max(maxes) == 1.0


def test_graph_groups_cover_every_step() -> None:
    from mpsrun.train.loop.data import ResidentBatches

    g = engine.GraphTrainer.__new__(engine.GraphTrainer)
    whole = ResidentBatches(torch.zeros(60000, 1), torch.zeros(60000, dtype=torch.long), 64, torch.device("cpu"), True, 0)
    groups = g._groups(whole, 60000)
    assert sum(k * b for k, b, _ in groups) == 60000
    assert groups[0] == (engine.GRAPH_STEPS, 64, 1.0) and groups[-1] == (1, 60000 % 64, 1.0)
    assert g._groups(whole, 128) == [(1, 64, 1.0), (1, 64, 1.0)]


@pytest.mark.parametrize("n,batch", [(1000, 64), (1023, 64), (1022, 64), (4096, 256)])
def test_graph_groups_of_data_parallel_ranks_match_their_shares(n: int, batch: int) -> None:
    """Under graphs each rank replays its share's steps with their loss weights (the tail's
    weight differs from 1 even when its size is a full share), and every rank replays the
    same number of steps in graphs captured in the same order: each step is a collective."""
    from mpsrun.train.loop.shards import ShardResidentBatches, StepWeight

    g = engine.GraphTrainer.__new__(engine.GraphTrainer)
    x, y = torch.zeros(n, 1), torch.zeros(n, dtype=torch.long)
    per_rank = []
    for rank in (0, 1):
        share = ShardResidentBatches(x, y, batch, torch.device("cpu"), 0, 2, rank, StepWeight(1.0, 2))
        groups = g._groups(share, share.n)
        steps = [(b, w) for k, b, w in groups for _ in range(k)]
        assert steps == list(zip(share.lay.steps, share.lay.weights))  # sizes and weights, step by step
        per_rank.append([k for k, _, _ in sorted(set(groups), reverse=True)])
    assert per_rank[0] == per_rank[1]


def test_profile_epoch_writes_the_named_epoch_s_table_and_says_so(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MPSRUN_PROFILE_EPOCH", "2")
    monkeypatch.setenv("MPSRUN_PROFILE_OUT", str(tmp_path / "prof-{rank}.txt"))
    setup = _setup("epochs=2", "optimizer.name=sgd")
    _train(setup)
    table = (tmp_path / "prof-0.txt").read_text()
    assert table.startswith("# epoch 2, rank 0") and "aten::addmm" in table  # the MLP's layers, in the training phase
    assert [n for n in setup.options.notes if n.startswith("profile: epoch 2's training phase")]
    monkeypatch.setenv("MPSRUN_PROFILE_EPOCH", "3")  # an epoch the run does not reach: no table, no note
    (tmp_path / "prof-0.txt").unlink()
    setup = _setup("epochs=2", "optimizer.name=sgd")
    _train(setup)
    assert not (tmp_path / "prof-0.txt").exists() and not [n for n in setup.options.notes if n.startswith("profile:")]


def test_graphs_requested_on_cpu_is_said_not_silent() -> None:
    setup = _setup("graphs=true", "epochs=1")
    assert setup.options.graphs is False
    assert any("CUDA graphs need a CUDA device" in n for n in setup.options.notes)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")


@cuda
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_cuda_graphs_match_eager_exactly(optimizer: str) -> None:
    """Same seed, same batches: graph replay must learn what eager steps learn."""
    # capturable in both runs: the comparison is of graph replay, not of two Adam variants
    capt = ["optimizer.capturable=true"] if optimizer == "adam" else []
    over = ["device=cuda", "epochs=3", "batch_size=50", f"optimizer.name={optimizer}", *capt]
    eager = _train(_setup(*over, "graphs=false"))
    graphed_setup = _setup(*over, "graphs=true")
    assert graphed_setup.options.graphs
    graphed = _train(graphed_setup)
    assert graphed_setup.options.graphs, graphed_setup.options.notes  # no fallback happened
    assert graphed_setup.options.fused_linear, graphed_setup.options.notes  # the MLP's layers replayed as fused kernels
    for e, g in zip(eager.epochs, graphed.epochs):
        assert g.train_loss == pytest.approx(e.train_loss, rel=1e-4, abs=1e-5)
        assert g.val_accuracy == pytest.approx(e.val_accuracy, abs=2e-3)


@cuda
def test_a_capture_that_breaks_leaves_an_eager_run_that_draws_dropout_simulated() -> None:
    """A host read inside the step (simulated: a sync in the model's forward while capturing) breaks every capture:
    the run says so and trains eager, its dropout drawing from the default generator the broken captures had marked
    as capturing ("Offset increment outside graph capture encountered unexpectedly" before devices/graph_rng.py)."""
    s = _setup("device=cuda", "epochs=2", "model.dropout=0.3", "graphs=true")
    forward = s.model.forward

    def reading(x: torch.Tensor) -> torch.Tensor:
        y = forward(x)
        if torch.cuda.is_current_stream_capturing():
            float(y.sum())  # a host read: illegal while capturing
        return y

    s.model.forward = reading  # type: ignore[method-assign]
    res = _train(s)
    assert not s.options.graphs and any("graph capture failed" in n for n in s.options.notes), s.options.notes
    assert len(res.epochs) == 2 and all(0 < e.train_loss < 3 for e in res.epochs)
    torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)  # and after the run, outside any graph


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (run on the 2-GPU machine)")
def test_second_gpu_trains_with_graphs_and_fused_kernels() -> None:
    """`device=cuda:1`: Triton's kernels and the graphs' capture go to the current device, so the run makes cuda:1
    current (on 2x H100 before that: "Pointer argument cannot be accessed from Triton", and an empty graph)."""
    setup = _setup("device=cuda:1", "epochs=2")
    assert torch.cuda.current_device() == 1
    result = _train(setup)
    assert setup.options.graphs and setup.options.fused_linear, setup.options.notes  # nothing fell back
    assert result.epochs[-1].val_accuracy > 0.5
    torch.cuda.set_device(0)


def test_indexed_cuda_device_is_made_current_cuda_mock(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The logic of `make_current` where there is no GPU: `cuda:N` is set, plain `cuda` and the CPU are left alone."""
    from mpsrun.devices import resolve as devices

    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for d in ("cuda:1", "cuda", "cpu", "cuda:0"):
        devices.make_current(torch.device(d))
    assert calls == [torch.device("cuda:1"), torch.device("cuda:0")]


@cuda
def test_cuda_graphs_are_the_default_for_resident_data() -> None:
    setup = _setup("device=cuda", "epochs=1")  # resident_max_gb: auto decides after a measured step, under graphs alike
    assert setup.plan.graphable and setup.options.graphs
    setup = _setup("device=cuda", "epochs=1", "resident_max_gb=4")  # a number: placed at once
    assert setup.plan.resident and setup.options.graphs


def test_compile_failure_falls_back_to_eager_and_says_so(work, monkeypatch) -> None:
    """A real compiler failure: inductor pointed at a C++ compiler that is not there
    (as on a Mac without the command-line tools)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/c++"))
    r = work.cli("run", RECIPES / "digits_mlp.yaml", "device=cpu", "compile=true", "epochs=2", "-q")
    assert r.exit_code == 0, r.output
    assert "compile: torch.compile failed" in r.stdout and "running eager" in r.stdout
    run = work.runs("digits_mlp")[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["resolved.compile"] == "false"
    assert "torch.compile failed" in run.data.tags["mpsrun.notes"]
    assert run.data.metrics["val_accuracy"] > 0.5


def test_image_transform_matches_its_definition() -> None:
    from mpsrun import ImageTransform

    x = torch.randint(0, 256, (4, 1, 6, 6), dtype=torch.uint8)
    t = ImageTransform(mean=(0.3,), std=(0.2,), resize=8, rgb=True)
    ref = ((x.float() / 255 - 0.3) / 0.2)
    ref = torch.nn.functional.interpolate(ref, size=(8, 8), mode="bilinear", align_corners=False).expand(-1, 3, -1, -1)
    out = t(x)
    assert out.shape == (4, 3, 8, 8) and t.output_shape((1, 6, 6)) == (3, 8, 8)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(ImageTransform()(x), x.float() / 255)


@cuda
def test_image_transform_is_graph_capturable() -> None:
    """Normalising must not copy from the host inside a captured step."""
    from mpsrun import ImageTransform

    t = ImageTransform(mean=(0.3,), std=(0.2,), resize=32, rgb=True)
    x = torch.randint(0, 256, (8, 1, 28, 28), dtype=torch.uint8, device="cuda")
    expected = t(x)  # first call: coefficients cached, outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = t(x)
    g.replay()
    torch.testing.assert_close(out, expected)
