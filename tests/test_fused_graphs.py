"""Fused groups replayed as CUDA graphs (sweep/fused/graphed.py) against the eager group and the solo runs.

CUDA only (the GPU gate runs them); on a machine without CUDA they skip, and the CPU test below checks
that a CPU group stays the eager, bit-exact one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests.test_sweep_fused import BASE, PLACE, _Trial, _worst

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: fused groups replay as CUDA graphs there")


CNN_BASE = BASE.replace("  name: mlp\n  hidden: [16]\n", "  name: cnn\n  channels: [8, 16]\n  hidden: 32\n  dropout: 0.0\n  batch_norm: true\n")
assert CNN_BASE != BASE


def _members(tmp_path: Path, optimizer: str, variants: list[dict[str, Any]], device: str, name: str, base: str = BASE) -> tuple[list, list]:
    from mpsrun.plugins import resolve
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep.fused import members

    path = tmp_path / f"{name}.yaml"
    path.write_text(base.format(device=device, optimizer=optimizer))
    base = resolve(path)
    recs = [trial_recipe(base, {**v, **PLACE}) for v in variants]
    return [members.Member(_Trial(i), v, r, {}) for i, (v, r) in enumerate(zip(variants, recs))], recs


def _train(tmp_path: Path, optimizer: str, variants: list[dict[str, Any]], graphs: bool, name: str,
           verdict: Callable[[Any, int], Any] = lambda m, e: None) -> tuple[list, Any, list[str]]:
    """The variants as one group on CUDA, graphed or eager: (members, the group, what it said)."""
    from mpsrun.sweep.fused import engine, graphed, members

    mems, _ = _members(tmp_path, optimizer, variants, "cuda", name)
    said: list[str] = []
    b = members.build(mems, {})
    g = graphed.GraphedGroup(b, said.append) if graphs else engine.Group(b)
    g.run(lambda m, e, metrics: verdict(m, e))
    return mems, g, said


def _close(a: list, b: list, keys: tuple[str, ...] = ("train_loss", "val_loss", "val_accuracy")) -> float:
    worst = 0.0
    for ma, mb in zip(a, b):
        assert len(ma.history) == len(mb.history)
        for ea, eb in zip(ma.history, mb.history):
            for k in keys:
                worst = max(worst, abs(ea[k] - eb[k]) / max(abs(ea[k]), 1e-12))
    return worst


SGD = [{"optimizer.lr": 0.1, "optimizer.momentum": 0.9},
       {"optimizer.lr": 0.05, "optimizer.momentum": 0.5, "optimizer.dampening": 0.3, "optimizer.weight_decay": 1e-3, "seed": 3},
       {"optimizer.lr": 0.05, "optimizer.momentum": 0.8, "optimizer.nesterov": True}]


@CUDA
def test_a_graphed_group_trains_as_the_eager_group_on_cuda(tmp_path: Path) -> None:
    """Same kernels, replayed: SGD (momentum, dampening's undamped first step, nesterov, own seeds) and Adam;
    digits' 1,437 training rows at batch 32 replay groups of 16 steps, single steps and the short tail."""
    graphed_, g, said = _train(tmp_path, "sgd", SGD, True, "g")
    eager, _, _ = _train(tmp_path, "sgd", SGD, False, "e")
    assert g.eager is None and not said, said
    assert {k[:2] for k in g.graphs} >= {("train", 16 // len(SGD)), ("train", 1), ("val", 1)}  # graphed._groups: 16 steps / members
    assert _close(graphed_, eager) <= 1e-5
    adam = [{"optimizer.lr": 3e-3}, {"optimizer.lr": 1e-2, "optimizer.weight_decay": 1e-3, "seed": 2}]
    ga, _, _ = _train(tmp_path, "adam", adam, True, "ga")
    ea, _, _ = _train(tmp_path, "adam", adam, False, "ea")
    assert _close(ga, ea) <= 1e-5


def _against_solo(mems: list, recs: list) -> list[tuple[float, float]]:
    """(solo, fused) val_loss per epoch: each member's recipe trained alone by `mpsrun run`'s engine."""
    from mpsrun.train import runner
    from mpsrun.train.loop.engine import Listener, train

    pairs = []
    for m, r in zip(mems, recs):
        s = runner.prepare(r)
        res = train(s.model, s.optimizer, s.plan, s.choice.device, r.recipe.epochs, s.options, Listener(), objective=s.objective)
        pairs += [(em.val_loss, m.history[e]["val_loss"]) for e, em in enumerate(res.epochs)]
    return pairs


@CUDA
def test_graphed_members_follow_their_solo_runs_on_cuda(tmp_path: Path) -> None:
    mems, _, _ = _train(tmp_path, "sgd", SGD[:2], True, "gs")
    _, recs = _members(tmp_path, "sgd", SGD[:2], "cuda", "solo")
    pairs = _against_solo(mems, recs)
    assert _worst(pairs) <= 1e-3, pairs


@CUDA
def test_graphed_cnn_members_packed_channels_last_follow_their_solo_runs_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Conv + batch-norm members, their stages packed channels_last under graphs, against `mpsrun run`'s own
    engine (channels_last, fused pool/norm kernels): close, not equal. Convolutions in fp32 for both: with cuDNN's
    default TF32 the two drift 3% apart in two epochs (H200), which would hide a real difference. Learning rates a
    CNN with batch-norm trains smoothly at: at SGD[0]'s (0.1, momentum 0.9: a step of 1.0) the first epoch agreed to
    6e-6 and the second drifted 2.8% (H200), the order of the sums (cuDNN's or the unfolded weight gradient's) amplified;
    the layout itself is checked to 1e-4 step by step on CUDA by test_packed_convolution_stages_..."""
    from mpsrun.sweep.fused import graphed, members

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    gentle = [{"optimizer.lr": 0.02, "optimizer.momentum": 0.9}, {**SGD[1], "optimizer.lr": 0.02}]
    mems, recs = _members(tmp_path, "sgd", gentle, "cuda", "cnn", CNN_BASE)
    b = members.build(mems, {})
    said: list[str] = []
    g, _ = graphed.group_for(b, said.append)
    assert isinstance(g, graphed.GraphedGroup) and b.stacked.pack and b.stacked.channels_last
    g.run(lambda m, e, metrics: None)
    assert g.eager is None and not said, said
    pairs = _against_solo(mems, recs)
    assert _worst(pairs) <= 1e-2, pairs


@CUDA
def test_a_member_that_leaves_the_graphed_group_leaves_the_others_unchanged_on_cuda(tmp_path: Path) -> None:
    """Member 0 pruned after epoch 1: the graphs are captured again for the other two, whose numbers are the
    eager group's with the same departure."""
    leave = lambda m, e: ("PRUNED", "test") if m.number == 0 and e == 0 else None  # noqa: E731
    graphed_, g, _ = _train(tmp_path, "sgd", SGD, True, "gl", leave)
    eager, _, _ = _train(tmp_path, "sgd", SGD, False, "el", leave)
    assert [len(m.history) for m in graphed_] == [1, 2, 2]
    assert [m.state for m in graphed_] == ["PRUNED", "COMPLETE", "COMPLETE"]
    assert len(g.active) == 2 and g.eager is None
    assert _close(graphed_, eager) <= 1e-5


@CUDA
def test_dropout_members_replay_with_their_own_generators_on_cuda(tmp_path: Path) -> None:
    variants = [{"optimizer.lr": 0.1, "model.dropout": 0.3}, {"optimizer.lr": 0.1, "model.dropout": 0.3, "seed": 4}, {"optimizer.lr": 0.1, "model.dropout": 0.1}]
    mems, g, said = _train(tmp_path, "sgd", variants, True, "gd")
    assert g.eager is None and not said, said
    losses = [h["train_loss"] for m in mems for h in m.history]
    assert all(0 < v < 3 for v in losses), losses
    assert mems[0].history[1]["train_loss"] != mems[1].history[1]["train_loss"]  # own masks, own data order


@CUDA
def test_a_capture_that_fails_falls_back_to_eager_and_says_so_simulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operation that reads the host inside the step (simulated: a sync added to the step) cannot be captured:
    the group goes on eager, says why, and its numbers are the eager group's."""
    from mpsrun.sweep.fused import engine

    real = engine.Group._train_step

    def syncing(self: Any, x: torch.Tensor, y: torch.Tensor, *micro: Any) -> None:  # micro: accumulate's weight, first, last
        real(self, x, y, *micro)
        float(self.loss_sum.sum())  # a host read: illegal while capturing

    monkeypatch.setattr(engine.Group, "_train_step", syncing)
    graphed_, g, said = _train(tmp_path, "sgd", SGD[:2], True, "gf")
    monkeypatch.setattr(engine.Group, "_train_step", real)
    eager, _, _ = _train(tmp_path, "sgd", SGD[:2], False, "ef")
    assert g.eager and len(said) == 1 and "capturing the fused step failed" in said[0] and "runs eager" in said[0], said
    assert _close(graphed_, eager) <= 1e-6
    # the broken capture had marked the default generator as capturing: random ops outside graphs work again
    torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)


def test_a_cpu_group_stays_eager_and_exact(tmp_path: Path) -> None:
    from mpsrun.sweep.fused import engine, graphed, members

    mems, _ = _members(tmp_path, "sgd", SGD[:2], "cpu", "cpu")
    b = members.build(mems, {})
    g, note = graphed.group_for(b, lambda s: None)
    assert type(g) is engine.Group and note == "" and b.graphs is False  # type: ignore[attr-defined]


LAYOUTS = [("cpu", False, False, 1 << 30), ("cpu", True, False, 1 << 30), ("cpu", True, True, 1 << 30), ("cpu", True, False, 1),
           pytest.param("cuda", True, False, 1 << 30, marks=CUDA), pytest.param("cuda", True, True, 1 << 30, marks=CUDA)]


@pytest.mark.parametrize("device,channels_last,shared,chunk", LAYOUTS)
def test_packed_convolution_stages_compute_what_the_member_by_member_layout_does(device: str, channels_last: bool, shared: bool, chunk: int,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA layout (graphed.group_for packs conv stages: [B, M*C, H, W], channels_last) checked on the CPU against
    the [M, B, C, H, W] layout: outputs, every gradient and the batch-norm's running statistics. Also what that layout
    does differently: one dense convolution where every member has the same batch (`shared`), a ReLU moved after the
    max-pool that follows it, grouped weight gradients from the unfolded input (strides, dilation, no bias; `chunk`:
    a member at a time)."""
    from torch import nn

    from mpsrun.sweep.fused import layers, packed

    monkeypatch.setattr(packed, "WGRAD_CHUNK_BYTES", chunk)
    monkeypatch.setattr(packed, "WGRAD_ROWS", 64)  # the first layer's 384 rows summed in 6 slices, the later ones' 96 in one
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # CUDA: fp32 convolutions, so 1e-4 can tell a wrong layout

    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.ReLU()),
                             nn.Conv2d(4, 4, 3, padding=2, dilation=2), nn.Conv2d(4, 4, (3, 2), stride=2, padding=(1, 0), bias=False),
                             nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 5))

    x = torch.randn(1, 6, 3, 8, 8).expand(3, 6, 3, 8, 8) if shared else torch.randn(3, 6, 3, 8, 8)
    x = x.to(device)
    outs = []
    for pack in (False, True):
        st = layers.Stacked([model(s).to(device) for s in range(3)])
        st.pack, st.channels_last = pack, channels_last
        said: list[str] = []
        if pack and device == "cuda":  # the graphed group's max-pool kernels (used eagerly here)
            st.pools = packed.FastPools(st.layers, said.append)
        if pack:
            assert [type(st.layers[i]).__name__ for i in st.order()[1:4]] == ["BatchNorm2d", "MaxPool2d", "ReLU"]
        out = st(x)
        out.square().sum().backward()
        assert not said, said
        outs.append((out.detach(), [p.grad for p in st.params], [t.clone() for slot in st.where for k, t in slot.items() if "running" in k]))
    (o0, g0, r0), (o1, g1, r1) = outs
    assert o1.shape == o0.shape == (3, 6, 5)
    torch.testing.assert_close(o1, o0, rtol=1e-5, atol=1e-5)
    for a, b in zip(g0 + r0, g1 + r1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_packed_stages_under_bf16_autocast_give_the_member_by_member_layout_s_outputs(shared: bool) -> None:
    """precision: bf16 on the packed layout (checked on the CPU): the grouped convolution's own backward runs in bf16
    and hands fp32 gradients to the fp32 weights; outputs equal, gradients within bf16's rounding of other sums."""
    from torch import nn

    from mpsrun.sweep.fused import layers

    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(8, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))

    torch.manual_seed(1234)  # the same input wherever the test runs (it had the RNG state other tests left)
    x = torch.randn(1, 6, 3, 8, 8).expand(3, 6, 3, 8, 8) if shared else torch.randn(3, 6, 3, 8, 8)
    outs = []
    for pack in (False, True):
        st = layers.Stacked([model(s) for s in range(3)])
        st.pack, st.channels_last = pack, True
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            out = st(x)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in st.params)
        # per layer, its gradients (weight, bias) in the order the layer holds them
        outs.append((out.detach().float(), [[t.grad for t in slot.values() if t.grad is not None] for slot in st.where]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
    # The two layouts sum in bf16 in other orders. A gradient's rounding noise follows the size of the terms summed,
    # not of the sum: the first convolution's bias, which a batch norm follows, has a true gradient of ~1e-7 (its
    # terms cancel) and bf16 noise of ~1e-3 on either layout. So each member's gradients are compared per layer with
    # that layer's largest gradient of that member as the scale (the weight's: the same terms, multiplied by inputs of
    # size ~1): bf16's rounding (2^-8) of sums in another order stays within a few percent of it on any CPU kind,
    # while a member's or a channel's values crossed would be off by the order of the values themselves.
    layers_with_grads = [(g0, g1) for g0, g1 in zip(outs[0][1], outs[1][1]) if g0]
    assert len(layers_with_grads) == 4  # two convolutions, the batch norm, the linear
    for layer0, layer1 in layers_with_grads:
        for j in range(3):
            scale = max(float(g[j].abs().max()) for g in layer0)
            for a, b in zip(layer0, layer1):
                assert float((a[j] - b[j]).abs().max()) <= 6e-2 * scale + 1e-6, (j, [tuple(g.shape) for g in layer0])


def test_fast_pools_that_triton_cannot_build_leave_the_group_on_torch_s_and_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed stage's max-pool kernels (FastPools) on a GPU where Triton cannot build them: torch's max-pool, the
    same numbers, said once; the trial goes on (a compile error used to escape the check and fail the group)."""
    from torch import nn

    from mpsrun.sweep.fused import packed
    from mpsrun.train.kernels import fused_pool

    def cannot_build(*a: object, **k: object) -> None:
        raise RuntimeError("triton: PassManager::run failed")

    monkeypatch.setattr(fused_pool, "fits", lambda y: True)  # a CPU tensor stands in for a CUDA one: only the check runs
    monkeypatch.setattr(fused_pool, "check", cannot_build)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # no CUDA driver here to ask
    pool = nn.MaxPool2d(2)
    said: list[str] = []
    pools = packed.FastPools([nn.Conv2d(3, 4, 3), nn.ReLU(), pool], said.append)
    y = torch.randn(2, 4, 6, 6).contiguous(memory_format=torch.channels_last)
    assert torch.equal(pools(pool, y), pool(y))
    assert pools.off == "RuntimeError: triton: PassManager::run failed"
    assert said == ["pools: torch's max-pool kernels for this group, not the fused ones (RuntimeError: triton: PassManager::run failed)"]
    assert torch.equal(pools(pool, y[:1]), pool(y[:1])) and len(said) == 1
