"""docker/: there is no Docker engine here, so the files are checked as text and YAML.

What can drift is checked against its source of truth: the MLflow server's flags against
the test stack that runs them for real (tests/servers.py), ports against the commands
that open them, the runner against the README's install, and no secret in a committed file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.servers import BUCKET, MLFLOW_SERVER_FLAGS, mlflow_server_args

DOCKER = Path(__file__).resolve().parents[1] / "docker"
ROOT = DOCKER.parent


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _env_example() -> dict[str, str]:
    out = {}
    for line in (DOCKER / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?message}, as `docker compose config` does."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env and env[name] != "":
            return env[name]
        if op == ":-":
            return arg or ""
        raise AssertionError(f"compose needs ${{{name}}} but docker/.env.example does not set it")

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", sub, value)


def _flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_compose_has_the_stack_services(compose) -> None:
    services = compose["services"]
    assert {"postgres", "minio", "bucket", "mlflow", "runner"} <= set(services)
    assert services["postgres"]["image"].startswith("postgres:15")
    assert services["minio"]["image"].startswith("minio/minio")
    for name in ("postgres", "minio", "mlflow"):
        assert services[name]["healthcheck"]["test"], f"{name} has no healthcheck"
    # volumes keep the database and the bucket across `down`/`up`
    assert any(v.endswith(":/var/lib/postgresql/data") for v in services["postgres"]["volumes"])
    assert any(v.endswith(":/data") for v in services["minio"]["volumes"])
    named = set(compose["volumes"])
    for svc in ("postgres", "minio"):
        for v in services[svc]["volumes"]:
            assert v.split(":")[0] in named, f"{svc} volume {v} is not a named volume"


def test_mlflow_service_runs_the_test_stacks_command(compose) -> None:
    """Same flags, same order as tests/servers.py; values that fit the other services."""
    env = _env_example()
    svc = compose["services"]["mlflow"]
    argv = [_interpolate(str(a), env) for a in svc["command"]]
    assert argv[:2] == ["mlflow", "server"]
    assert _flags(argv) == list(MLFLOW_SERVER_FLAGS)
    ours = mlflow_server_args("postgresql+psycopg://u@h:1/d", "s3://b/a", "127.0.0.1", 1, 1, "h")
    assert _flags(ours) == list(MLFLOW_SERVER_FLAGS)

    backend = _after(argv, "--backend-store-uri")
    m = re.fullmatch(r"postgresql\+psycopg://([^:]+):([^@]+)@(\w+):(\d+)/(\w+)", backend)
    assert m, backend
    user, password, host, port, db = m.groups()
    assert (user, password, db) == (env["POSTGRES_USER"], env["POSTGRES_PASSWORD"], env["POSTGRES_DB"])
    assert host == "postgres" and port == "5432"

    dest = _after(argv, "--artifacts-destination")
    assert dest == f"s3://{env['MLFLOW_BUCKET']}/artifacts"
    assert env["MLFLOW_BUCKET"] == BUCKET
    assert _after(argv, "--host") == "0.0.0.0"
    port = _after(argv, "--port")
    assert any(p.endswith(f":{port}") for p in svc["ports"]), "published port does not match --port"
    assert f"localhost:{port}" in str(svc["healthcheck"]["test"])
    assert f"mlflow:{port}" in _after(argv, "--allowed-hosts").split(","), "runners reach the server as mlflow:PORT"

    # the server alone holds the S3 credentials and endpoint; the runner none
    assert svc["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(svc["environment"])
    runner_env = compose["services"]["runner"]["environment"]
    assert runner_env["MLFLOW_TRACKING_URI"] == f"http://mlflow:{port}"
    assert not {k for k in runner_env if k.startswith("AWS_") or k == "MLFLOW_S3_ENDPOINT_URL"}


def test_minio_bucket_job_makes_the_bucket_mlflow_writes_to(compose) -> None:
    services = compose["services"]
    minio_cmd = services["minio"]["command"]
    assert _after(minio_cmd, "--address") == ":9000"
    job = " ".join(services["bucket"]["command"])
    assert "http://minio:9000" in job and "mc mb" in job and "$$MLFLOW_BUCKET" in job
    assert services["bucket"]["depends_on"]["minio"]["condition"] == "service_healthy"
    deps = services["mlflow"]["depends_on"]
    assert deps["postgres"]["condition"] == "service_healthy"
    assert deps["bucket"]["condition"] == "service_completed_successfully"
    assert services["runner"]["depends_on"]["mlflow"]["condition"] == "service_healthy"


def test_mlflow_image_adds_the_drivers_the_test_stack_uses() -> None:
    text = (DOCKER / "mlflow.Dockerfile").read_text()
    assert re.search(r"^FROM \S*mlflow", text, re.M)
    assert "psycopg[binary]" in text and "boto3" in text
    import mlflow

    pinned = re.search(r"ARG MLFLOW_VERSION=(\S+)", text)
    assert pinned and pinned.group(1).split(".")[0] == mlflow.__version__.split(".")[0], "server image's MLflow major differs from the client's"


def test_runner_dockerfile_installs_as_the_readme_does() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM python:\$\{PYTHON_VERSION\}-slim", text, re.M)
    assert re.search(r"^ARG PYTHON_VERSION=3\.\d+", text, re.M)
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert "cpu)" in text and "cuda)" in text, "both variants are handled"
    assert "python3 -m venv .venv" in text and ".venv/bin/pip install -e ." in text
    readme = (ROOT / "README.md").read_text()
    assert "python3 -m venv .venv" in readme and '.venv/bin/pip install -e "' in readme
    for copied in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / copied).exists(), f"Dockerfile copies {copied}, which the repository lacks"
    assert re.search(r'^ENTRYPOINT \["mpsrun"\]', text, re.M)
    cmd = re.search(r"^CMD (\[.*\])", text, re.M)
    assert cmd and (ROOT / yaml.safe_load(cmd.group(1))[1]).is_file()


def test_runner_service_builds_that_dockerfile(compose) -> None:
    runner = compose["services"]["runner"]
    context = (DOCKER / runner["build"]["context"]).resolve()
    assert context == ROOT and (context / runner["build"]["dockerfile"]).is_file()
    assert (DOCKER / compose["services"]["mlflow"]["build"]["dockerfile"]).is_file()
    assert (ROOT / runner["command"][1]).is_file(), "the runner's default recipe exists"


def test_no_secrets_committed(compose) -> None:
    """Passwords come from docker/.env (ignored); compose and the example hold none."""
    seen = 0
    for name, svc in compose["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            if "PASSWORD" in key or "SECRET" in key:
                seen += 1
                assert str(value).startswith("${"), f"{name}: {key} is set in compose.yaml itself"
    assert seen >= 4
    assert ":${POSTGRES_PASSWORD}@" in " ".join(compose["services"]["mlflow"]["command"])
    assert all(v.startswith("change-me") for k, v in _env_example().items() if "PASSWORD" in k)
    ignored = (ROOT / ".gitignore").read_text().splitlines() if (ROOT / ".gitignore").exists() else []
    assert any(line.strip() in ("docker/.env", ".env", "*.env") for line in ignored), "docker/.env is not git-ignored"
