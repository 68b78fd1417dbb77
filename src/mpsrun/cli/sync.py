"""`sync`: replay writes spooled while the tracking store was away."""

from __future__ import annotations

from typing import Optional

import typer

from mpsrun.cli.common import EXIT_FAIL, app, console, err, require_store


@app.command()
def sync(
    tracking_uri: Optional[str] = typer.Option(
        None, "--tracking-uri", help="Store whose spooled writes to replay; default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns/mlflow.db."
    ),
) -> None:
    """Replay metrics, params, tags, artifacts and final statuses that runs spooled while the store was away."""
    require_store(tracking_uri)
    from mpsrun.track.store import sync as replay

    uri = replay.resolve(tracking_uri)
    results = replay.replay_all(uri)
    if not results:
        console.print(f"nothing to sync for {uri} (no spooled writes in {replay.where(uri)})", highlight=False, soft_wrap=True)
        return
    failed = 0
    for r in results:
        if r.error is None:
            console.print(f"run {r.run_id}: {r.ops} spooled writes replayed", highlight=False)
        else:
            failed += 1
            err.print(f"[red]run {r.run_id}:[/] {r.ops} replayed, then: {r.error} (the rest stay in {r.path})", highlight=False, soft_wrap=True)
    if failed:
        raise typer.Exit(EXIT_FAIL)
