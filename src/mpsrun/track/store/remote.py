"""A tracking server that cannot be reached: refuse fast, never hang.

Why. MLflow's HTTP client retries a refused connection with exponential backoff
(by default 7 retries, up to minutes: 252 s measured against a closed port) and
then raises a raw traceback. A user who mistyped a URI waits four minutes for an
exit 1. So before any data loads, `require_reachable` asks the server's
`/health` once with a short timeout (a plain socket-level HTTP GET, no retries),
and a refusal is bad input (exit 2) naming the URI and what to check. And
`bound_http_retries` caps MLflow's own retries and timeouts (its documented
environment variables, only where the user has not set them), so that a server
that goes away during training makes a write fail in seconds; the tracker then
spools it (`mpsrun.track.store.spool`) instead of stalling training.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

PROBE_TIMEOUT_S = 3.0
# MLflow's knobs (mlflow.environment_variables); set only when the user has not.
HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


class Unreachable(Exception):
    """The tracking server did not answer: bad input, exit code 2."""


def is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def bound_http_retries() -> None:
    """Cap MLflow's HTTP retries and timeouts unless the user chose their own."""
    for k, v in HTTP_LIMITS.items():
        os.environ.setdefault(k, v)


def probe(uri: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the server at `uri` answers HTTP at all; else why not, in words.

    Any HTTP answer counts (even 401/404: a server is there, and MLflow will say
    what is wrong with the request); only no answer is refused.
    """
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout):  # noqa: S310 - the user's own tracking URI
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:
        return str(getattr(e, "reason", e))
    except (TimeoutError, OSError) as e:
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except ValueError as e:  # a malformed URL
        return str(e)


def require_reachable(uri: str) -> None:
    """Raise Unreachable (with what to check) when `uri` is an HTTP server that does not answer.

    Non-HTTP stores (SQLite, a database URI) are checked when opened; this only bounds
    the one case that otherwise hangs.
    """
    if not is_http(uri):
        return
    bound_http_retries()
    why = probe(uri)
    if why is not None:
        raise Unreachable(
            f"tracking server {uri} is not reachable ({why}, within {PROBE_TIMEOUT_S:g} s). "
            "Check that the server is running (mlflow server --host ... --port ...), the host and port, "
            "proxies and firewalls; or leave out --tracking-uri / MLFLOW_TRACKING_URI to use the local store."
        )
