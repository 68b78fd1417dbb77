"""Real processes for the hardening tests: free ports, an `mlflow server`, process trees,
and a plugin package visible to subprocesses (through PYTHONPATH, as pip would install it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
MPSRUN = str(BIN / "mpsrun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """Can a new server listen on `port`? (SO_REUSEADDR, as servers bind: TIME_WAIT does not count.)"""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_http(url: str, timeout: float = 90.0, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except OSError:
            time.sleep(0.3)
    return False


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


class MlflowServer:
    """`mlflow server` on a free port, backed by SQLite and an artifact folder in tmp."""

    def __init__(self, root: Path, template_db: Path | None = None) -> None:
        self.root = root
        if template_db is not None:  # an already-migrated empty store: saves the server seconds of migrations
            import shutil

            shutil.copy(template_db, root / "server.db")
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = root / "server.log"

    def start(self) -> None:
        cmd = [
            str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
        ]
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=clean_env(), stdout=log, stderr=log, start_new_session=True)
        assert wait_http(f"{self.uri}/health", 120, self.proc), self.log.read_text()[-3000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the whole server process group at once (workers included)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while not port_free(self.port) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.proc = None


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc: no extra library)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


HELD_PLUGIN = '''
import os, time
from torch import nn

def held_mlp(num_classes: int, input_shape: tuple, hold: str = ""):
    """An MLP whose training steps sleep while the file `hold` exists: the test sets the pace."""
    class Held(nn.Module):
        def __init__(self):
            super().__init__()
            n = 1
            for s in input_shape:
                n *= s
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(n, 32), nn.ReLU(), nn.Linear(32, num_classes))
        def forward(self, x):
            if self.training and hold and os.path.exists(hold):
                time.sleep(0.2)
            return self.net(x)
    return Held()
'''


def plugin_site(root: Path, name: str = "heldplug", source: str = HELD_PLUGIN, models: dict[str, str] | None = None) -> Path:
    """A package with entry points, importable by a subprocess given PYTHONPATH=<returned dir>."""
    site = root / f"site_{name}"
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{name}_mod.py").write_text(textwrap.dedent(source))
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    eps = ["[mpsrun.models]"] + [f"{k} = {name}_mod:{v}" for k, v in (models or {"held_mlp": "held_mlp"}).items()]
    (info / "entry_points.txt").write_text("\n".join(eps) + "\n")
    return site


def in_triton_interpreter(code: str, timeout: int = 300) -> Any:
    """Run `code` in a child Python under Triton's CPU interpreter (TRITON_INTERPRET=1 must be set before triton is
    imported, hence a child) and return the JSON of its last line of output.

    Why one helper: the kernels' tests check their Triton code this way on a machine without a GPU; on a CUDA
    machine each file's `_cuda` test runs the compiled kernels instead, so this skips there (and without Triton)."""
    import json

    import pytest
    import torch

    pytest.importorskip("triton", reason="Triton is not installed here (it ships with torch's Linux wheels)")
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the _cuda test runs the kernels themselves")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
