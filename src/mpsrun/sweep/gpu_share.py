"""Whether sweep workers sharing one NVIDIA GPU run their kernels at once or take turns: said before they start.

Why: without NVIDIA's Multi-Process Service (MPS), kernels of different processes never run at once on a
GPU; the driver gives each process's queue the whole GPU in turn (time-slicing). A small model whose step
keeps the GPU busy (the fashion MLP under CUDA graphs: about 75% of the time) then gains little from more
workers. Measured on one H100 (`benchmarks/sweep_share_gpu.sh`, 32 trials of the shipped fashion recipe,
10 epochs each): 4 workers took 0.87x the wall time of one taking turns, 0.68x under MPS (0.50-0.67x once
the workers started first). Reading the driver's files keeps torch out of the launching command's path: no
CUDA context is made to ask. Below: the private daemon `--gpu-sharing auto` starts, so a user gets MPS
without knowing about it, and nothing outside the sweep is changed by it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

from mpsrun.plugins.nvidia import PROC, visible_gpus


def mps_running() -> bool:
    """An MPS control daemon answers at $CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps)."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


@dataclass(frozen=True)
class Sharing:
    """How `workers` share the NVIDIA GPUs the recipe's device names: what `note()` words and `arrange()` decides from."""

    workers: int
    gpus: int  # visible to the sweep
    per_gpu: int  # the most workers on one GPU (> 1)
    mps: bool  # an MPS daemon answers: their kernels run at once

    def who(self) -> str:
        """The first words of the note: how many workers on how many GPUs."""
        if self.per_gpu == self.workers:
            return f"{self.workers} workers share one GPU"
        return f"{self.workers} workers on {self.gpus} GPUs: up to {self.per_gpu} share each"


def sharing_of(workers: int, device: str, proc: str = PROC) -> Optional[Sharing]:
    """How `workers` share the recipe's `device`, or None when each has its own GPU (or uses none)."""
    if workers <= 1 or device not in ("auto", "cuda") and not device.startswith("cuda:"):
        return None
    n = visible_gpus(proc)
    if not n:
        return None  # no NVIDIA GPU here
    per = -(-workers // n) if device in ("auto", "cuda") else workers  # worker i takes cuda:(i % n); a pinned device: all on it
    if per <= 1:
        return None  # a GPU each
    return Sharing(workers, n, per, mps_running())


def at_once(s: Sharing, how: str = "through NVIDIA MPS") -> str:
    """The note where MPS runs: the workers' kernels run at once."""
    return f"{s.who()} {how}: their kernels run at once"


def taking_turns(s: Sharing) -> str:
    """The note's first sentence where no MPS runs: the workers take turns."""
    return f"{s.who()} and take turns on it (time-slicing: kernels of different processes never run at once)"


def words(s: Sharing) -> str:
    """The note on screen and in the parent run's notes."""
    if s.mps:
        return at_once(s)
    return (f"{taking_turns(s)}; "
            "NVIDIA MPS lets them (`--gpu-sharing auto` starts it where `nvidia-cuda-mps-control` is installed; docs/guides/sweeps.md)")


def note(workers: int, device: str, proc: str = PROC) -> Optional[str]:
    """The note for `workers` sharing the recipe's `device`, or None when each has its own GPU (or uses none)."""
    s = sharing_of(workers, device, proc)
    return None if s is None else words(s)


# --- a private MPS daemon for the sweep's workers -------------------------------------------------------------
# `mpsrun sweep --gpu-sharing auto` (the default) starts one where workers would share an NVIDIA GPU and no daemon
# runs: its pipe and log folders are this sweep's own (CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY, set for
# worker 0 here and inherited by the others), so processes outside the sweep never connect to it, and it is
# stopped when the sweep ends, or by a watchdog shell if the command is killed (kill -9 included).

SHARING = ("auto", "nvidia-mps", "time-slicing")
CONTROL = "nvidia-cuda-mps-control"

# A CUDA context made through the driver API alone (no torch: 0.1 s of Python, not torch's import): under MPS it is
# what connects to the daemon's server, so a server that cannot start fails here, not in every trial.
PROBE = """
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
for what, rc in (("cuInit", lambda: cu.cuInit(0)), ("cuDeviceGet", lambda: cu.cuDeviceGet(ctypes.byref(dev), 0)),
                 ("cuDevicePrimaryCtxRetain", lambda: cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))):
    r = rc()
    if r:
        sys.exit(f"{what} returned CUDA error {r}")
"""


@dataclass
class Daemon:
    """A running private MPS control daemon; `stop()` quits it and restores this process's environment."""

    exe: str
    folder: str
    env: dict
    watchdog: Optional[subprocess.Popen] = None
    saved: dict = field(default_factory=dict)

    def stop(self) -> None:
        """Quit the daemon without waiting for it: on the H100 `quit` took about 10 s to return (its server's
        shutdown), which the sweep's user would wait for after the last trial. A detached shell quits it and
        removes its folder; the watchdog (the same work, after this process dies) is no longer needed."""
        if self.watchdog is not None and self.watchdog.poll() is None:
            self.watchdog.kill()
            self.watchdog.wait()
        try:
            subprocess.Popen(["sh", "-c", _finish(self.exe, self.folder)], env=self.env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            pass
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _finish(exe: str, folder: str) -> str:
    """The shell line that quits the daemon, then removes its pipe and log folder."""
    return f"echo quit | '{exe}'; rm -rf '{folder}'"


def wanted(sharing: str, s: Sharing) -> bool:
    """Whether to start a daemon for workers sharing an NVIDIA GPU: none runs, and the user did not say time-slicing."""
    return sharing != "time-slicing" and not s.mps


def start(timeout_s: float = 30.0) -> "Daemon | str":
    """A private daemon started and checked with a CUDA context, or why not (the sweep then takes turns, and says so)."""
    exe = shutil.which(CONTROL)
    if exe is None:
        return f"{CONTROL} is not on PATH"
    folder = tempfile.mkdtemp(prefix="mpsrun-nvidia-mps-")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": os.path.join(folder, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(folder, "log")}
    os.makedirs(env["CUDA_MPS_PIPE_DIRECTORY"])
    os.makedirs(env["CUDA_MPS_LOG_DIRECTORY"])
    daemon = Daemon(exe, folder, env)
    errors = os.path.join(folder, "start.err")
    try:
        with open(errors, "wb") as err:  # a file, not a pipe: the forked daemon would hold a pipe open
            rc = subprocess.run([exe, "-d"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, timeout=timeout_s).returncode
        if rc != 0:
            raise RuntimeError(f"`{CONTROL} -d` exited {rc}: {_tail(errors)}")
        deadline = time.monotonic() + 5.0
        while not os.path.exists(os.path.join(env["CUDA_MPS_PIPE_DIRECTORY"], "control")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"`{CONTROL} -d` made no control pipe: {_tail(os.path.join(env['CUDA_MPS_LOG_DIRECTORY'], 'control.log'))}")
            time.sleep(0.01)
        # The watchdog: the daemon must not outlive the sweep (a killed command cannot stop it itself).
        daemon.watchdog = subprocess.Popen(
            ["sh", "-c", f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; {_finish(exe, folder)}"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        p = subprocess.run([sys.executable, "-c", PROBE], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, timeout=timeout_s)
        if p.returncode != 0:
            log = _tail(os.path.join(env["CUDA_MPS_LOG_DIRECTORY"], "server.log")) or _tail(os.path.join(env["CUDA_MPS_LOG_DIRECTORY"], "control.log"))
            raise RuntimeError(f"a CUDA context under it failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}" + (f" ({log})" if log else ""))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        daemon.stop()  # quits it (if it started) and removes the folder, detached
        return str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
    for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        daemon.saved[k] = os.environ.get(k)
        os.environ[k] = env[k]
    return daemon


def _tail(path: str, lines: int = 2) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(x.strip() for x in f.read().strip().splitlines()[-lines:])
    except OSError:
        return ""


def arrange(sharing: str, workers: int, device: str, proc: str = PROC) -> "tuple[Optional[Daemon], Optional[str]]":
    """The daemon (or None) and the note to say: how workers sharing a GPU will run, and why where MPS was wanted but failed.

    `nvidia-mps` that cannot start is an error (exit 2, raised as ValueError); `auto` falls back to taking turns, said.
    """
    s = sharing_of(workers, device, proc)
    if s is None:
        return None, None  # a GPU each, or none
    if not wanted(sharing, s):
        return None, words(s)
    got = start()
    if isinstance(got, Daemon):
        return got, at_once(s, "through NVIDIA MPS (a daemon this sweep started and stops at its end)")
    if sharing == "nvidia-mps":
        raise ValueError(f"--gpu-sharing nvidia-mps: NVIDIA MPS could not start: {got}")
    return None, taking_turns(s) + f"; NVIDIA MPS, which lets them run at once, could not start: {got} (--gpu-sharing time-slicing to not try)"
