"""Many `mpsrun` processes on one embedded SQLite store, at once.

Why. MLflow creates and migrates a SQLite database on first use (alembic, with
temporary tables), and creates an experiment when its name is new. Two processes
doing that at once collide: `table _alembic_tmp_latest_metrics already exists`, an
exit 1, and sometimes a half-migrated store left for the next run. So the first
touch of a store and the experiment's creation run under a file lock beside the
database (`mlflow.db.lock`, the `filelock` library: works on Linux, macOS, Windows,
released by the OS if the holder dies). After that, SQLite serialises writers
itself; a writer that still meets `database is locked` (another process held the
write lock longer than SQLite's busy timeout) is retried with backoff instead of
losing the write.

Remote stores (http, postgresql, ...) need none of this: the server or the
database serialises; the lock is a no-op there.
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

LOCK_TIMEOUT_S = 300.0  # a migration takes seconds; a stuck lock file should not hang forever
RETRY_FOR_S = 30.0  # a locked store is retried this long in all (a migration in another process takes seconds)
RETRY_FIRST_S = 0.02
# The longest single wait. SQLite gives a deferred transaction that must upgrade its read lock `database is
# locked` at once while another connection writes (no busy wait: it would deadlock), and writers hold the
# lock for milliseconds; with a cap of 3 s, a writer among four sweep workers' helpers lost the race several
# times in a row and slept up to 3 s per loss (a child run's creation took 7.3 s on the H100).
RETRY_MAX_S = 0.25


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI, else None."""
    if not uri.startswith("sqlite:///"):
        return None
    rest = uri.removeprefix("sqlite:///").split("?")[0]  # SQLAlchemy: sqlite:////abs, sqlite:///relative
    if not rest or rest == ":memory:":
        return None
    return Path(rest)


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Hold the store's creation/migration lock (a no-op for non-SQLite stores)."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    from filelock import FileLock

    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db) + ".lock", timeout=LOCK_TIMEOUT_S):
        yield


def is_locked_error(e: BaseException) -> bool:
    """SQLite's "database is locked" / "database table is locked", however MLflow wrapped it."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        text = str(cur).lower()
        if "database is locked" in text or "database table is locked" in text:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def retry_locked(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call `fn`; on `database is locked` wait (exponential backoff with jitter, capped at RETRY_MAX_S) and call again.

    Other errors pass through at once. The last locked error is raised once RETRY_FOR_S have passed.
    """
    delay = RETRY_FIRST_S
    deadline = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if not is_locked_error(e) or time.monotonic() >= deadline:
                raise
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, RETRY_MAX_S)


class RetryingClient:
    """An MlflowClient whose every call is retried on `database is locked`.

    A thin proxy rather than a subclass, so it wraps whatever client object MLflow
    returns; attributes that are not callables pass through unchanged.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            return retry_locked(attr, *args, **kwargs)

        return call
