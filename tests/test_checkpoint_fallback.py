"""A truncated checkpoint is not a dead end: `prev.pt` is kept, resume takes the newest readable one.

Real runs on a real SQLite store; the damage is real too (files cut in half on disk, as a
full disk or an upload cut off leaves them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.test_checkpoint import DIGITS


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_last_resumes_from_the_newest_readable_checkpoint(work: Any) -> None:
    work.write("q.yaml", DIGITS)  # mode max on val_loss: the best epoch is the first, older than prev
    r = work.cli("run", "q.yaml", "checkpoint.mode=max", "tracking.log_model=false", "-q")
    assert r.exit_code == 0, r.output
    (run,) = work.runs("quick")
    rid = run.info.run_id
    folder = Path(run.info.artifact_uri.removeprefix("file://")) / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["best.pt", "last.pt", "prev.pt"]  # nothing half-written left
    assert torch.load(folder / "prev.pt", weights_only=False)["epoch"] == 1  # the last one before, kept
    logged = dict(work.history(rid, "val_loss"))

    _cut(folder / "last.pt")
    r = work.cli("resume", rid, "epochs=4", "-q")
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "checkpoints/last.pt is not a readable mpsrun checkpoint" in said and "going on from checkpoints/prev.pt" in said, said
    done = work.client().get_run(rid)
    assert "going on from checkpoints/prev.pt" in done.data.tags["mpsrun.resume.1.checkpoint"]  # tagged as well as said
    assert done.info.status == "FINISHED"
    got = sorted(work.history(rid, "val_loss"))
    assert [s for s, _ in got] == [0, 1, 2, 3], got  # epoch 3 trained again from prev.pt, logged once
    assert sorted(s for s, _ in work.history(rid, "train_loss")) == [0, 1, 2, 3]  # every per-epoch metric once
    again = torch.load(folder / "last.pt", weights_only=False)
    assert again["epoch"] == 3
    assert abs(again["history"][2]["val_loss"] - logged[2]) <= 1e-6  # along the same trajectory as the first time

    for name in ("last.pt", "prev.pt", "best.pt"):
        _cut(folder / name)
    r = work.cli("resume", rid, "epochs=5")
    assert r.exit_code == 2, r.output
    said = " ".join(r.stderr.split())
    assert "has no readable checkpoint" in said and all(n in said for n in ("last.pt", "prev.pt", "best.pt")), said
    assert "Traceback" not in r.output


def test_a_short_copy_never_replaces_a_whole_checkpoint(tmp_path: Path) -> None:
    """The store side: a `last.pt` that is not whole is never kept as `prev.pt`, and a put is verified."""
    from mpsrun.track.store.runs import RunFiles, whole

    good = tmp_path / "good.pt"
    torch.save({"format": 1, "epoch": 0}, good)
    assert whole(good)
    files = RunFiles.__new__(RunFiles)
    files.local = tmp_path / "art"
    files.put(good, "last.pt")
    files.rotate("last.pt", "prev.pt")
    files.put(good, "last.pt")
    ck = tmp_path / "art" / "checkpoints"
    assert whole(ck / "prev.pt") and whole(ck / "last.pt")
    _cut(ck / "last.pt")
    assert not whole(ck / "last.pt")
    files.rotate("last.pt", "prev.pt")  # a damaged last.pt does not overwrite the good prev.pt
    assert whole(ck / "prev.pt")
