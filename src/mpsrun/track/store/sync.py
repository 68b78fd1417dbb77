"""Replaying every spooled run of a store (`mpsrun sync`), after the store is back.

Kept in the tracking wing so the CLI never touches MLflow: it asks for the results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from mpsrun.track.store import spool
from mpsrun.track.store.client import client, resolve_uri


@dataclass
class Replayed:
    run_id: str
    ops: int
    path: Path
    error: str | None = None


def resolve(cli_uri: str | None) -> str:
    return resolve_uri(cli_uri)[0]


def where(uri: str) -> Path:
    return spool.spool_dir(uri)


def replay_all(uri: str) -> list[Replayed]:
    """Replay each run's spool in order; a run that fails keeps its remaining writes."""
    runs = list(spool.spooled_runs(uri))
    if not runs:
        return []
    c = client(uri)
    out = []
    for sp in runs:
        before = sp.count()
        try:
            n = sp.replay(c)
        except Exception as e:
            out.append(Replayed(sp.run_id, before - sp.count(), sp.path, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
            continue
        c.set_tag(sp.run_id, "mpsrun.spool.synced", f"{n} spooled writes replayed by mpsrun sync at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
        out.append(Replayed(sp.run_id, n, sp.path))
    return out
