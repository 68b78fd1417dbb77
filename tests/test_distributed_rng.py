"""Each rank of a DDP job resumes from its own random state (train/keep/checkpoint.py: `rng_ranks`).

Two real ranks (gloo, two processes) drive the Checkpointer as the engine does: rank 0
writes the checkpoint, every rank takes part in gathering the random states at the
epoch's end. Resumed from that checkpoint (rank 0 reads it, the others get it by
broadcast, as train/keep/resume.py does), each rank must draw exactly what it would have
drawn had the job gone on. A checkpoint without per-rank states (older, or written by
another world size) makes every rank continue from rank 0's, and rank 0 says so.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, os, shutil, sys
import torch
from torch import nn
from mpsrun.recipe.model import CheckpointSection
from mpsrun.train.keep import checkpoint
from mpsrun.train.ranks import distributed
from mpsrun.train.controls.callbacks import RunState

rank, tmp, mode = int(os.environ["RANK"]), sys.argv[1], sys.argv[2]
distributed.init(distributed.Context(rank, rank, 2, 2, 1), torch.device("cpu"))
torch.manual_seed(100 + rank)  # the ranks draw different streams (their dropout masks differ)
model = nn.Linear(2, 2)
run = RunState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), epochs=3)
spec = CheckpointSection(every=1 if rank == 0 else 0)  # as train/keep/continuity.py: rank 0 alone writes
notes = []
if mode == "save":
    ck = checkpoint.Checkpointer(spec, 0, note=notes.append)
    ck.on_fit_start(run)
    torch.rand(5)  # the epoch's draws
    ck.on_epoch_end(run, 0, {"val_loss": 1.0})
    ck.wait()
    if rank == 0:
        shutil.copy(ck.directory / checkpoint.LAST, os.path.join(tmp, "last.pt"))
    out = {"draw": torch.rand(4).tolist()}  # what epoch 1 draws first, had the job gone on
else:  # resume, twice: from the checkpoint as written, then as one without per-rank states (older, or other ranks)
    state = checkpoint.load(os.path.join(tmp, "last.pt")) if rank == 0 else None
    state = distributed.broadcast_object(state)
    out = {}
    for name, ck_state in (("own", state), ("old", {k: v for k, v in state.items() if k != "rng_ranks"})):
        notes.clear()
        checkpoint.Checkpointer(spec, 0, note=notes.append, restore=ck_state).on_fit_start(run)
        out[name] = {"draw": torch.rand(4).tolist(), "notes": list(notes)}
print(json.dumps(out), flush=True)
distributed.shutdown()
os._exit(0)  # as train/ranks/teardown.py ends a rank: no interpreter teardown under gloo's threads
"""


def _job(tmp: Path, mode: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "MPSRUN_DIST_TIMEOUT_S": "60"}
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(tmp), mode], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_each_rank_resumes_from_its_own_random_state(tmp_path: Path) -> None:
    went_on = _job(tmp_path, "save")
    assert went_on[0]["draw"] != went_on[1]["draw"]  # the ranks' streams differ: the test can tell them apart
    resumed = _job(tmp_path, "resume")
    assert [r["own"]["draw"] for r in resumed] == [r["draw"] for r in went_on]
    assert resumed[0]["own"]["notes"] == []
    old = [r["old"] for r in resumed]  # a checkpoint with one random state: rank 0's for everyone, said by rank 0
    assert old[0]["draw"] == went_on[0]["draw"] and old[1]["draw"] == went_on[0]["draw"]
    assert any("rank 0's random state" in n for n in old[0]["notes"])
