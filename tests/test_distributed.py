"""Data-parallel training: `mpsrun run --nproc N` and `torchrun ... -m mpsrun run`, on the CPU (gloo).

Real processes through torch's elastic agent, a real MLflow SQLite store. Each DDP job
costs seconds of gloo and interpreter start-up on a 2-core machine, so there are
three: the trajectory check, torchrun, and a rank that dies.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mpsrun.train.ranks import distributed

from mpsrun.train.loop import shards

RECIPE = """\
device: cpu
epochs: {epochs}
batch_size: 32
seed: 0
dataset: {{name: digits}}
model: {{name: {model}}}
optimizer: {{name: sgd, lr: 0.05}}
tracking: {{experiment: ddp}}
"""
# The same without the logged model and figures, for tests that check epochs and ranks only (the model's export is
# seconds of a 2-core machine a run; test_nproc_2_is_one_run_on_the_single_process_trajectory checks them for a job).
LIGHT = RECIPE.replace("tracking: {{experiment: ddp}}", "tracking: {{experiment: ddp, log_model: false, figures: false}}")

ENV = {"OMP_NUM_THREADS": "1", "MPSRUN_DIST_TIMEOUT_S": "60", "PYTHONWARNINGS": "ignore"}


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _sub(args: list[str], cwd: Path, extra: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV, **(extra or {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)


# ----------------------------------------------------------------------------- shares (no processes)


@pytest.mark.parametrize("n,batch,world", [(1437, 32, 2), (100, 8, 4), (64, 32, 2), (33, 16, 2), (35, 16, 4)])
def test_ranks_share_every_global_batch_contiguously(n: int, batch: int, world: int) -> None:
    lays = [shards.layout(n, batch, world, r) for r in range(world)]
    steps = {len(lay.steps) for lay in lays}
    assert len(steps) == 1  # every rank takes every step: each is a collective
    covered = torch.cat([lay.positions for lay in lays]).sort().values
    tail = n % batch
    kept = n - (tail if 0 < tail < world else 0)
    assert covered.tolist() == list(range(kept))
    for step in range(len(lays[0].steps)):  # rank r's slice of step k comes before rank r+1's
        starts = [int(lay.positions[sum(lay.steps[:step])]) for lay in lays]
        assert starts == sorted(starts)
        sizes = [lay.steps[step] for lay in lays]
        total = sum(sizes)
        weights = [lay.weights[step] for lay in lays]
        # DDP's weighted average equals the global mean: sum_r (w_r / world) * mean_r = sum_r size_r / total * mean_r
        for w, s in zip(weights, sizes):
            assert w / world == pytest.approx(s / total)
    assert lays[0].dropped == (tail if 0 < tail < world else 0)


def test_loader_share_follows_the_single_process_order() -> None:
    """The DataLoader path: each rank's batches are slices of the batches one process would draw."""
    from torch.utils.data import DataLoader

    n, batch, world = 103, 16, 2
    single = [b.tolist() for b in DataLoader(range(n), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(3))]
    per_rank = []
    for r in range(world):
        g = torch.Generator().manual_seed(3)
        sampler = shards._ShareSampler(n, batch, world, r, g)
        per_rank.append([b.tolist() for b in DataLoader(range(n), batch_sampler=sampler, generator=g)])
    assert [a + b for a, b in zip(*per_rank)] == single


def test_bad_jobs_are_refused_before_any_rank_starts(work) -> None:  # type: ignore[no-untyped-def]
    r = work.write("r.yaml", RECIPE.format(epochs=1, model="mlp"))
    res = work.cli("run", str(r), "batch_size=63", "--nproc", "2")
    assert res.exit_code == 2
    assert "batch_size 63" in res.stderr and "2 ranks" in res.stderr and "batch_size=62 or 64" in res.stderr
    assert work.runs("ddp") == []
    with pytest.raises(ValueError, match="MPS has no multi-process backend"):
        distributed.backend_for("mps")
    assert distributed.backend_for("cpu") == "gloo" and distributed.backend_for("cuda") == "nccl"


def test_launch_refuses_mps_mocked(work, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """MPS (mocked usable: this Linux machine has none) exits 2 naming the missing backend."""
    from mpsrun.devices import resolve as devices

    monkeypatch.setattr(devices, "unusable_reason", lambda name: None)
    r = work.write("r.yaml", RECIPE.format(epochs=1, model="mlp").replace("device: cpu", "device: mps"))
    res = work.cli("run", str(r), "--nproc", "2")
    assert res.exit_code == 2
    assert "MPS has no multi-process backend" in res.stderr


def test_single_process_is_untouched() -> None:
    t = torch.tensor(3.0)
    distributed.reduce_sums(t)
    assert t.item() == 3.0 and distributed.is_main_process() and distributed.world_size() == 1
    assert distributed.from_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    ctx = distributed.from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"})
    assert ctx is not None and (ctx.rank, ctx.local_rank, ctx.nodes, ctx.main) == (3, 1, 2, False)


def test_nccl_defaults_leave_a_user_s_own_setting_alone() -> None:
    env: dict[str, str] = {}
    assert distributed.nccl_defaults(env) == {"NCCL_GRAPH_MIXING_SUPPORT": "0"} and env == {"NCCL_GRAPH_MIXING_SUPPORT": "0"}
    mine = {"NCCL_GRAPH_MIXING_SUPPORT": "1"}
    assert distributed.nccl_defaults(mine) == {} and mine == {"NCCL_GRAPH_MIXING_SUPPORT": "1"}


# ----------------------------------------------------------------------------- real jobs


def test_nproc_2_is_one_run_on_the_single_process_trajectory(work) -> None:  # type: ignore[no-untyped-def]
    r = work.write("r.yaml", RECIPE.format(epochs=3, model="mlp"))  # 1437 samples: a tail of 29, shared 15/14
    one = work.cli("run", str(r), "-q")
    assert one.exit_code == 0, one.output
    p = _sub([_bin("mpsrun"), "run", str(r), "-q", "--nproc", "2"], work.path)
    assert p.returncode == 0, p.stdout + p.stderr
    runs = work.runs("ddp")
    assert len(runs) == 2  # the single-process run and ONE run for the two ranks
    single, ddp = runs
    t = ddp.data.tags
    assert ddp.info.status == "FINISHED"
    assert (t["distributed.world_size"], t["distributed.backend"], t["distributed.nodes"]) == ("2", "gloo", "1")
    assert "distributed.world_size" not in single.data.tags
    assert "device=cpu" in t["distributed.rank.0"] and "device=cpu" in t["distributed.rank.1"]
    assert t["distributed.rank.0"] != t["distributed.rank.1"]  # each rank's own facts (pid differs)
    assert ddp.data.params["data.train_size"] == "1437" and ddp.data.params["data.val_size"] == "360"
    a, b = work.history(single.info.run_id, "val_loss"), work.history(ddp.info.run_id, "val_loss")
    assert [s for s, _ in a] == [s for s, _ in b] == [0, 1, 2]
    for (_, x), (_, y) in zip(a, b):
        assert abs(x - y) < 1e-4, (a, b)
    acc_a = work.history(single.info.run_id, "val_accuracy")
    acc_b = work.history(ddp.info.run_id, "val_accuracy")
    assert acc_a == acc_b  # counts over the whole validation set, reduced across ranks
    assert ddp.data.tags["mpsrun.model_uri"] == f"runs:/{ddp.info.run_id}/model"  # logged once, by rank 0
    assert {"distributed_ranks.json", "figures", "recipe.yaml"} <= {f.path for f in work.client().list_artifacts(ddp.info.run_id)}

    # `--nproc 1` resumes the 2-rank run in one process, saying why the trajectory stays the same
    more = work.cli("resume", ddp.info.run_id, "epochs=4", "--nproc", "1", "-q")
    assert more.exit_code == 0, more.output
    said = " ".join(more.stdout.split())
    assert "trained on 2 ranks" in said and "resuming on one process" in said and "batch_size stays the global batch" in said
    t = work.client().get_run(ddp.info.run_id).data.tags
    assert t["distributed.world_size"] == "1" and "world size 2 -> 1" in t["mpsrun.resume.1"]
    assert [s for s, _ in work.history(ddp.info.run_id, "val_loss")] == [0, 1, 2, 3]


def test_accumulate_under_nproc_2_follows_the_single_process_run(work) -> None:  # type: ignore[no-untyped-def]
    """accumulate: 3 (groups of 3 global batches of 32; the epoch's last group ends on the shared tail of 29)."""
    r = work.write("r.yaml", LIGHT.format(epochs=2, model="mlp") + "accumulate: 3\n")
    one = work.cli("run", str(r), "-q")
    assert one.exit_code == 0, one.output
    p = _sub([_bin("mpsrun"), "run", str(r), "-q", "--nproc", "2"], work.path)
    assert p.returncode == 0, p.stdout + p.stderr
    single, ddp = work.runs("ddp")
    assert ddp.data.tags["distributed.world_size"] == "2" and ddp.data.params["accumulate"] == "3"
    for key in ("val_loss", "train_loss"):
        a, b = work.history(single.info.run_id, key), work.history(ddp.info.run_id, key)
        assert [s for s, _ in a] == [s for s, _ in b] == [0, 1]
        for (_, x), (_, y) in zip(a, b):
            assert abs(x - y) < 1e-4, (key, a, b)


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None, reason="torchrun not installed beside python")
def test_torchrun_gives_one_run(work) -> None:  # type: ignore[no-untyped-def]
    r = work.write("r.yaml", LIGHT.format(epochs=1, model="mlp"))
    p = _sub([_bin("torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "mpsrun", "run", str(r), "-q"], work.path)
    assert p.returncode == 0, p.stdout + p.stderr
    runs = work.runs("ddp")
    assert len(runs) == 1
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["distributed.world_size"] == "2"
    assert runs[0].data.tags["distributed.launcher"] == "torchrun"


BOOM = """\
import os
import torch
from torch import nn


class Boom(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.lin = nn.Linear(64, num_classes)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.training and os.environ.get("RANK") == "1" and self.calls > 60:  # in epoch 2 (45 steps each)
            raise RuntimeError("boom on rank 1")
        return self.lin(x.flatten(1))


def boom(num_classes: int) -> nn.Module:
    return Boom(num_classes)
"""


def test_a_dying_rank_takes_the_job_down_and_is_named(work, fake_dist) -> None:  # type: ignore[no-untyped-def]
    site = fake_dist("boom-plugin", BOOM, models={"boom": "boom"})
    r = work.write("r.yaml", LIGHT.format(epochs=3, model="boom"))
    t0 = time.monotonic()
    p = _sub([_bin("mpsrun"), "run", str(r), "-q", "--nproc", "2"], work.path, {"PYTHONPATH": str(site)}, timeout=180)
    took = time.monotonic() - t0
    assert p.returncode == 1, p.stdout + p.stderr
    assert took < 150
    assert "rank 1" in p.stderr
    runs = work.runs("ddp")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FAILED"
    assert run.data.tags["distributed.failed_ranks"] == "1"
    assert "rank 1 failed" in run.data.tags["mpsrun.error"] and "boom on rank 1" in run.data.tags["mpsrun.error"]
    assert len(work.history(run.info.run_id, "val_loss")) == 1  # epoch 1 finished and was logged


# ----------------------------------------------------------------------------- how a rank ends

LATE_CALLBACK = """\
import sys, time
import torch, torch.distributed as dist
from mpsrun.train.ranks import distributed
from mpsrun.train.ranks import teardown

ctx = distributed.from_env()
distributed.init(ctx, torch.device("cpu"))
model = distributed.wrap(torch.nn.Linear(2, 2), torch.device("cpu"))  # DDP's reducer keeps the group (and its threads) alive
if ctx.rank == 0:
    time.sleep(1.5)  # joins late: rank 1's gloo worker completes the collective, and runs its callback, only then
    dist.all_reduce(torch.ones(4))
else:
    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(lambda f: f.value()[0])
    del fut

    class Slow:  # a slow interpreter teardown, as on a loaded machine: the worker is late into it
        def __del__(self, sleep=time.sleep):
            sleep(3)

    import builtins
    builtins.slow = Slow()
if sys.argv[1] == "teardown":
    teardown.finish(0)
"""


def test_a_rank_ends_without_finalisation_under_a_late_gloo_worker(tmp_path: Path) -> None:
    """The flake behind `terminate called without an active exception` (rank 1, after a job that succeeded).

    A gloo worker thread that needs the GIL (a Python callback, a tensor Python dropped)
    after CPython began finalising is ended with pthread_exit, and the unwind through a
    C++ destructor aborts the process. Here the worker is made late on purpose: ending
    the way Python does aborts (on the Pythons that end such threads), ending through
    `teardown.finish` (what the CLI does for every rank) exits 0.
    """
    from tests.proc_helpers import free_port

    script = tmp_path / "late.py"
    script.write_text(LATE_CALLBACK)

    def job(mode: str) -> list[subprocess.CompletedProcess]:
        port = str(free_port())
        procs = []
        for r in range(2):
            env = {**os.environ, **ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r)}
            procs.append(subprocess.Popen([sys.executable, str(script), mode], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return outs

    ended = job("teardown")
    assert [p.returncode for p in ended] == [0, 0], [p.stderr[-2000:] for p in ended]
    assert not any("terminate called" in p.stderr for p in ended)
    if sys.version_info < (3, 14):  # 3.14 parks such threads instead of ending them
        python = job("python")
        assert python[1].returncode == -6 and "terminate called without an active exception" in python[1].stderr, python[1].stderr[-2000:]


# ----------------------------------------------------------------------------- resume keeps the world size


def test_a_stopped_2_rank_job_resumes_on_2_ranks_on_the_same_trajectory(work, tmp_path: Path, fake_dist) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM (preemption) of `run --nproc 2` after epoch 1 of 3; `mpsrun resume ID` runs 2 ranks again.

    The reference is the uninterrupted single-process run (in-process: no job start-up),
    the trajectory a 2-rank run follows (test_nproc_2_is_one_run_on_the_single_process_trajectory).
    """
    from tests.proc_helpers import HELD_PLUGIN

    site = fake_dist("heldplug", HELD_PLUGIN, models={"held_mlp": "held_mlp"})  # in this process and, through PYTHONPATH, in the ranks
    hold = tmp_path / "hold"  # while it exists, every training step sleeps 0.2 s: the test sets the pace
    recipe = LIGHT.format(epochs=3, model="held_mlp").replace("batch_size: 32", "batch_size: 64")  # 23 steps; a tail of 29 (15/14)
    r = work.write("r.yaml", recipe.replace("{name: held_mlp}", f"{{name: held_mlp, hold: '{hold}'}}"))
    extra = {"PYTHONPATH": str(site)}
    ref = work.cli("run", str(r), "-q")  # uninterrupted (no hold file)
    assert ref.exit_code == 0, ref.output
    hold.touch()
    env = {**os.environ, **ENV, **extra}
    env.pop("MLFLOW_TRACKING_URI", None)
    job = subprocess.Popen([_bin("mpsrun"), "run", str(r), "-q", "--nproc", "2"], cwd=work.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_id = None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and run_id is None:  # epoch 1's checkpoint is in: stop the job in epoch 2
        time.sleep(0.5)
        for run in work.runs("ddp")[1:]:
            if run.data.tags.get("mpsrun.checkpoint.epoch") == "0":
                run_id = run.info.run_id
    assert run_id is not None, "no checkpoint of epoch 0 within 180 s"
    job.send_signal(signal.SIGTERM)
    out, errs = job.communicate(timeout=120)
    assert job.returncode == 143, out + errs
    stopped = work.client().get_run(run_id)
    assert stopped.info.status == "KILLED"
    assert [s for s, _ in work.history(run_id, "val_loss")] == [0]
    hold.unlink()

    res = _sub([_bin("mpsrun"), "resume", run_id, "-q"], work.path, extra)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "launching 2 ranks" in res.stdout
    run = work.client().get_run(run_id)
    t = run.data.tags
    assert run.info.status == "FINISHED"
    assert t["distributed.world_size"] == "2" and t["mpsrun.resumed"] == "1"
    assert t["distributed.rank.1"] != stopped.data.tags["distributed.rank.1"]  # the new job's ranks (pids)
    a, b = work.history(ref_id := work.runs("ddp")[0].info.run_id, "val_loss"), work.history(run_id, "val_loss")
    assert ref_id != run_id
    assert [s for s, _ in b] == [0, 1, 2]  # each epoch logged once
    for (_, x), (_, y) in zip(a, b):
        assert abs(x - y) < 1e-4, (a, b)
    assert [s for s, _ in work.history(run_id, "train_loss")] == [0, 1, 2]


def _graph_sync_rank(rank: int, init: str, out: str) -> None:
    """One rank: the same seeded model trained 3 steps with DDP, and with graph_sync's flat all-reduce."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mpsrun.train.ranks import graph_sync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 16, 2, 4, 4, generator=gen), torch.randint(0, 4, (3, 16), generator=gen)
    mine = slice(8 * rank, 8 * (rank + 1))  # this rank's half of each global batch of 16
    results = []
    for kind in ("ddp", "graph_sync", "buckets", "tail"):
        torch.manual_seed(0)
        # a channels_last convolution: its weight's gradient is not contiguous (flattened in memory order)
        model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(),
                                    torch.nn.Linear(64, 4)).to(memory_format=torch.channels_last)
        assert not model[0].weight.is_contiguous()
        if rank == 1:  # different start on rank 1: both paths must hand every rank rank 0's weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        # graph_sync: one bucket, all-reduced after backward; buckets: one per parameter (1-byte buckets),
        # each issued by its gradient's hook during backward (as under a captured step), the last layer's first
        # tail: the first layers (convolution, batch-norm: 336 bytes) in a last bucket of their own, the rest size-filled
        sizes = {"buckets": {"bucket_bytes": 1}, "tail": {"bucket_bytes": 500, "tail_bytes": 400}}.get(kind, {})
        net = DDP(model) if kind == "ddp" else graph_sync.install(model, 2, **sizes)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for s in range(3):
            opt.zero_grad(set_to_none=True)
            if kind in ("buckets", "tail"):
                graph_sync.arm()
                assert len(graph_sync._sync.buckets) == (6 if kind == "buckets" else 2)  # type: ignore[union-attr]
            if kind == "tail":
                assert graph_sync._sync.buckets[-1][-1] is model[0].weight  # type: ignore[union-attr]
            torch.nn.functional.cross_entropy(net(x[s, mine].contiguous(memory_format=torch.channels_last)), y[s, mine]).backward()
            assert not model[0].weight.grad.is_contiguous()  # the gradient keeps the weight's layout
            if kind in ("buckets", "tail"):
                assert all(i is not None for i in graph_sync._sync.issued)  # type: ignore[union-attr]  # every bucket went out during backward
            graph_sync.sync_grads()  # a no-op under DDP (not installed yet / reset)
            if kind != "ddp":  # every gradient a view of its averaged bucket, in its own layout (no copy back)
                assert all(p.grad._base is not None and p.grad.stride() == p.stride() for p in model.parameters())
            opt.step()
        graph_sync.reset()
        results.append([p.detach().clone() for p in model.parameters()])
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def test_graph_sync_buckets_keep_the_first_layers_for_a_small_last_bucket() -> None:
    """ResNet18's buckets: every parameter once, the size-filled ones in reverse, the first layers (at most 1 MiB) last
    and alone; no tail where the model is one bucket, or where it is switched off."""
    import torchvision

    from mpsrun.train.ranks import graph_sync

    params = list(torchvision.models.resnet18().parameters())
    out = graph_sync.buckets(params, graph_sync.BUCKET_BYTES, graph_sync.TAIL_BYTES)
    assert sorted(id(p) for b in out for p in b) == sorted(id(p) for p in params)
    assert out[-1][-1] is params[0] and sum(p.numel() * 4 for p in out[-1]) <= 2**20
    assert out[0][0] is params[-1] and len(out) == 3
    assert len(graph_sync.buckets(params, graph_sync.BUCKET_BYTES, 0)) == 2  # the first layers inside a 15 MB bucket
    assert len(graph_sync.buckets(params, 2**62, graph_sync.TAIL_BYTES)) == 2  # a tail, then the rest in one
    small = list(torch.nn.Linear(10, 10).parameters())
    assert graph_sync.buckets(small, graph_sync.BUCKET_BYTES, graph_sync.TAIL_BYTES) == [small[::-1]]


def test_graph_sync_average_is_ddp_s_on_gloo_processes(tmp_path: Path) -> None:
    """The all-reduce a captured step issues itself (train/ranks/graph_sync.py; captured only
    under NCCL on CUDA, measured on the GPU machine) gives DDP's parameters, step by step, on
    two real gloo processes, and rank 0's starting weights on both ranks."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "params")
    mp.spawn(_graph_sync_rank, args=(f"file://{tmp_path / 'rdv'}", out), nprocs=2, join=True)
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    for ddp, mine, bucketed, tailed in zip(r0[0], r0[1], r0[2], r0[3]):
        assert torch.allclose(ddp, mine, atol=1e-6)
        assert torch.allclose(ddp, bucketed, atol=1e-6)
        assert torch.allclose(ddp, tailed, atol=1e-6)
    for a, b in zip(r0[1] + r0[2] + r0[3], r1[1] + r1[2] + r1[3]):
        assert torch.equal(a, b)
