"""A real shared tracking stack for the tests: PostgreSQL 15, moto's S3 server, `mlflow server`.

The stack is the one `docker/compose.yaml` describes, run from local binaries instead of
images: PostgreSQL from the machine's PostgreSQL 15 binaries (as the `postgres` user when
we are root, because PostgreSQL refuses to run as root), moto's S3 server standing in for
MinIO, and `mlflow server` on PostgreSQL with its artifacts proxied into the bucket. Only
the MLflow server holds S3 credentials; clients talk HTTP to it, exactly as in the compose
stack.

`MLFLOW_SERVER_FLAGS` and `mlflow_server_args` are the single place that says how the
MLflow server is started: `tests/test_docker_files.py` checks that compose's `mlflow`
service passes the same flags.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tests.proc_helpers import free_port

# The flags every MLflow server of this project is started with, in this order
# (the test stack here and the `mlflow` service of docker/compose.yaml).
MLFLOW_SERVER_FLAGS: tuple[str, ...] = (
    "--backend-store-uri",
    "--artifacts-destination",
    "--serve-artifacts",
    "--host",
    "--port",
    "--workers",
    "--allowed-hosts",
)
BUCKET = "mpsrun"
ARTIFACTS_PREFIX = "artifacts"
# Stand-in credentials, known to moto; never real ones. Only the server's env holds them.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
# Everything through which a process could find S3 credentials; stripped from clients.
S3_CLIENT_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "MLFLOW_S3_ENDPOINT_URL")
STARTUP_TIMEOUT_S = 90.0


def mlflow_server_args(backend_store_uri: str, artifacts_destination: str, host: str, port: int | str, workers: int | str, allowed_hosts: str) -> list[str]:
    """`mlflow server ...` arguments, flags in MLFLOW_SERVER_FLAGS order.

    --serve-artifacts: clients upload and download through the server (mlflow-artifacts:/),
    so they need no S3 credentials. --allowed-hosts: MLflow 3's host-header check admits
    only localhost and private IPs by default; a compose service name must be listed.
    """
    return [
        "server",
        "--backend-store-uri", backend_store_uri,
        "--artifacts-destination", artifacts_destination,
        "--serve-artifacts",
        "--host", host,
        "--port", str(port),
        "--workers", str(workers),
        "--allowed-hosts", allowed_hosts,
    ]


def pg_bin_dir() -> Path | None:
    """The PostgreSQL 15 binaries: $MPSRUN_PG_BIN, Debian's /usr/lib/postgresql/15/bin, else PATH."""
    candidates = [os.environ.get("MPSRUN_PG_BIN", ""), "/usr/lib/postgresql/15/bin", *sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for c in candidates:
        if c and (Path(c) / "initdb").is_file() and (Path(c) / "postgres").is_file():
            return Path(c)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb and (Path(initdb).parent / "postgres").is_file() else None


def missing_parts() -> str | None:
    """Why the stack cannot start here, or None."""
    if pg_bin_dir() is None:
        return "PostgreSQL binaries (initdb, postgres) not found in /usr/lib/postgresql/*/bin or PATH: apt-get install postgresql-15"
    if os.geteuid() == 0 and not _user_exists("postgres"):
        return "running as root but there is no `postgres` user to run PostgreSQL as"
    for mod, pkg in (("moto.server", "moto[server]"), ("boto3", "boto3"), ("psycopg", "psycopg[binary]")):
        try:
            __import__(mod)
        except ImportError:
            return f"{pkg} is not installed (pip install -e '.[dev]')"
    return None


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _wait(what: str, check: Callable[[], bool], proc: subprocess.Popen | None, log: Path | None, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting:\n{_tail(log)}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s:\n{_tail(log)}")


def _tail(log: Path | None, n: int = 4000) -> str:
    if log is None or not log.exists():
        return ""
    return log.read_text(errors="replace")[-n:]


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 5.0) -> None:
    """Stop a process we started, and its children (it leads its own session).

    Throwaway servers: after a short grace the whole group is killed; nothing is kept.
    """
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=15)


@dataclass
class Postgres:
    """A throwaway PostgreSQL cluster in a temporary folder, on a free loopback port."""

    base: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    database: str = "mlflow"

    @property
    def log(self) -> Path:
        return self.base / "postgres.log"

    def _as_postgres(self) -> dict[str, Any]:
        """PostgreSQL will not run as root: drop to the `postgres` user when we are root."""
        return {"user": "postgres", "group": "postgres", "extra_groups": []} if os.geteuid() == 0 else {}

    def start(self) -> "Postgres":
        bindir = pg_bin_dir()
        assert bindir is not None
        data, sock = self.base / "data", self.base / "sock"
        sock.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres", "postgres")
            shutil.chown(sock, "postgres", "postgres")
        subprocess.run(
            [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync", "--no-instructions"],
            check=True, capture_output=True, text=True, cwd=self.base, **self._as_postgres(),
        )
        self.port = free_port()
        with open(self.log, "w") as out:
            if os.geteuid() == 0:
                shutil.chown(self.log, "postgres", "postgres")
            # Durability off: a test database that dies with the test needs no fsync.
            self.proc = subprocess.Popen(
                [str(bindir / "postgres"), "-D", str(data), "-p", str(self.port), "-k", str(sock),
                 "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
                stdout=out, stderr=subprocess.STDOUT, cwd=self.base, start_new_session=True, **self._as_postgres(),
            )
        _wait("PostgreSQL", lambda: bool(self.query("SELECT 1", dbname="postgres")), self.proc, self.log)
        import psycopg

        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')
        return self

    def dsn(self, dbname: str | None = None) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname or self.database}"

    @property
    def sqlalchemy_uri(self) -> str:
        """The backend-store URI for MLflow: psycopg 3 (psycopg[binary]), not psycopg2."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{self.database}"

    def query(self, sql: str, params: tuple = (), dbname: str | None = None) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.dsn(dbname), connect_timeout=5) as conn:
            return list(conn.execute(sql, params).fetchall())

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc, signal.SIGINT)  # PostgreSQL's "fast" shutdown


@dataclass
class S3:
    """moto's S3 server (the stand-in for MinIO) with the bucket made."""

    base: Path
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "S3":
        self.port = free_port()
        log = self.base / "moto.log"
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **S3_ENV},
            )
        _wait("moto S3 server", lambda: urllib.request.urlopen(self.endpoint, timeout=2).status < 500, self.proc, log)
        self.client().create_bucket(Bucket=BUCKET)
        return self

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"], region_name=S3_ENV["AWS_DEFAULT_REGION"])

    def keys(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)


@dataclass
class Stack:
    """PostgreSQL + S3 + `mlflow server`, and how a credential-free client reaches it."""

    base: Path
    pg: Postgres
    s3: S3
    port: int = 0
    proc: subprocess.Popen | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.base / "mlflow-server.log"

    def server_env(self) -> dict[str, str]:
        """The server alone gets the S3 credentials and endpoint."""
        return {**os.environ, **S3_ENV, "MLFLOW_S3_ENDPOINT_URL": self.s3.endpoint}

    def client_env(self) -> dict[str, str]:
        """A client that could not reach the bucket by itself: no credentials, no endpoint."""
        env = {k: v for k, v in os.environ.items() if k not in S3_CLIENT_VARS}
        env["AWS_SHARED_CREDENTIALS_FILE"] = env["AWS_CONFIG_FILE"] = os.devnull
        env["MLFLOW_TRACKING_URI"] = self.url
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def start_mlflow(self) -> None:
        self.port = free_port()
        args = mlflow_server_args(
            backend_store_uri=self.pg.sqlalchemy_uri,
            artifacts_destination=f"s3://{BUCKET}/{ARTIFACTS_PREFIX}",
            host="127.0.0.1", port=self.port, workers=1,
            allowed_hosts=f"127.0.0.1:{self.port},localhost:{self.port}",
        )
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", *args], stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env=self.server_env(), cwd=self.base,
            )
        _wait("mlflow server", lambda: urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200, self.proc, self.log, timeout=180)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
        self.s3.stop()
        self.pg.stop()
        shutil.rmtree(self.base, ignore_errors=True)


def start_stack() -> Stack:
    """PostgreSQL and S3 start side by side; the MLflow server once the database answers.

    The folder is made with tempfile (in /tmp, which every user can traverse) rather than
    pytest's tmp_path, whose parents are private to root and so closed to `postgres`.
    """
    base = Path(tempfile.mkdtemp(prefix="mpsrun-stack-"))
    os.chmod(base, 0o755)
    (base / "pg").mkdir()
    stack = Stack(base, Postgres(base / "pg"), S3(base))
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(2) as pool:
            pg_f = pool.submit(stack.pg.start)
            s3_f = pool.submit(stack.s3.start)
            pg_f.result()
            stack.timings["postgres_s"] = time.monotonic() - t0
            s3_f.result()
            stack.timings["s3_s"] = time.monotonic() - t0
        stack.start_mlflow()
        stack.timings["mlflow_s"] = time.monotonic() - t0
    except BaseException:
        stack.stop()
        raise
    return stack
