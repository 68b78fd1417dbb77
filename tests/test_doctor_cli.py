"""`mpsrun doctor` through the real CLI, and the device facts every run records.

This machine (CI: Linux, no GPU) really lacks MPS and CUDA, so the reasons checked
here are the real ones; the usable-CUDA screen is simulated (`cuda_mock`).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from mpsrun.devices import backends, host

from .conftest import RECIPES

LINUX_NO_GPU = sys.platform.startswith("linux") and not torch.cuda.is_available()
NAMESPACES = ("device.", "cpu.", "mps.", "cuda.", "sw.")


@pytest.mark.skipif(not LINUX_NO_GPU, reason="checks the reasons a GPU-less Linux machine gives")
def test_doctor_says_precisely_why_mps_and_cuda_are_unusable_here(work) -> None:
    r = work.cli("doctor")
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())  # the table may wrap long reasons
    assert "✓ cpu usable" in out
    assert "✗ mps unusable" in out and "this is Linux, not macOS; MPS needs an Apple-silicon Mac" in out
    assert "✗ cuda unusable" in out
    assert ("no NVIDIA driver or GPU found" in out) or ("built without CUDA" in out)
    for fact in ("brand", "cores_logical", "torch_threads", "built", "available", "min_macos", "PYTORCH_ENABLE_MPS_FALLBACK", "runtime"):
        assert fact in out, fact
    for pkg in ("python", "torch", "torchvision", "mlflow"):
        assert f" {pkg} " in out, pkg
    assert "recommended device: cpu" in out


@pytest.mark.skipif(not LINUX_NO_GPU, reason="mps and cuda must be really absent")
def test_doctor_device_exit_codes(work) -> None:
    assert work.cli("doctor", "--device", "cpu").exit_code == 0
    assert work.cli("doctor", "--device", "mps").exit_code == 1
    assert work.cli("doctor", "--device", "cuda:0").exit_code == 1
    r = work.cli("doctor", "--device", "tpu")
    assert r.exit_code == 2 and "unknown device 'tpu'" in r.stderr


def test_doctor_json_parses_and_holds_every_fact(work, monkeypatch) -> None:
    monkeypatch.setenv("PYTORCH_ENABLE_MPS_FALLBACK", "1")
    r = work.cli("doctor", "--json")
    assert r.exit_code == 0
    report = json.loads(r.stdout)
    b = report["backends"]
    assert set(b) == {"cpu", "mps", "cuda"}
    assert b["cpu"]["usable"] is True
    assert {"brand", "cores_logical", "cores_physical", "torch_threads"} <= set(b["cpu"]["details"])
    assert b["mps"]["details"]["PYTORCH_ENABLE_MPS_FALLBACK"] == "1"
    assert {"built", "min_macos"} <= set(b["mps"]["details"])
    assert "runtime" in b["cuda"]["details"]
    for name in ("mps", "cuda"):
        if not b[name]["usable"]:
            assert b[name]["reason"] and b[name]["hint"], name  # why, and what to do
    assert {"python", "torch", "torchvision", "mlflow"} <= set(report["software"])
    assert report["software"]["torch"] == torch.__version__
    assert report["recommended_device"] in ("cpu", "mps", "cuda")


def test_doctor_cuda_mock_lists_each_gpu(work, monkeypatch) -> None:
    props = [SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 1024**3)]
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    monkeypatch.setattr(backends, "_cuda_driver_version", lambda: "580.65.06")
    r = work.cli("doctor", "--json", "--device", "cuda")
    assert r.exit_code == 0, r.output
    cuda = json.loads(r.stdout)["backends"]["cuda"]
    assert cuda["usable"] is True
    d = cuda["details"]
    assert (d["gpu0"], d["gpu0.capability"], d["gpu0.memory_gib"]) == ("NVIDIA H100 80GB HBM3", "9.0", "80.0")
    assert (d["driver"], d["runtime"], d["device_count"]) == ("580.65.06", "13.0", "1")
    r = work.cli("doctor")
    assert "NVIDIA H100 80GB HBM3" in r.stdout and "recommended device: cuda" in r.stdout


def test_every_run_carries_namespaced_device_and_software_tags(work) -> None:
    r = work.cli("run", RECIPES / "digits_mlp.yaml", "epochs=1", "device=cpu", "-q")
    assert r.exit_code == 0, r.output
    tags = work.runs("digits_mlp")[0].data.tags
    named = {k: v for k, v in tags.items() if k.startswith(NAMESPACES)}
    assert len(named) >= 8, sorted(named)
    for ns in NAMESPACES:
        assert any(k.startswith(ns) for k in named), ns
    assert all(v and v != "unknown" for k, v in named.items() if k in ("cpu.brand", "sw.torch", "sw.mlflow", "sw.python", "device.type"))
    assert named["device.type"] == "cpu" and named["sw.torch"] == torch.__version__
    assert named["mps.available"] == host._yn(torch.backends.mps.is_available())
