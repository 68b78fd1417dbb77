"""Tests for mpsrun.devices.sysinfo (host, backends) and mpsrun.devices.doctor.

The real-machine tests assume what CI has: Linux, no GPU. The Mac branch is
exercised with monkeypatched probes (tests named ``*mps_mock*``), the CUDA
"usable" branch with fake device properties (``*cuda_mock*``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mpsrun.devices import backends, doctor, host, sysinfo

ON_LINUX_NO_GPU = sys.platform.startswith("linux") and not torch.cuda.is_available()
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Cached probes must not leak a simulated Mac into other tests."""
    host._cpu_brand.cache_clear()
    host._physical_cores.cache_clear()
    host._is_rosetta.cache_clear()
    yield
    host._cpu_brand.cache_clear()
    host._physical_cores.cache_clear()
    host._is_rosetta.cache_clear()


# --------------------------------------------------------------------- this machine


def test_cpu_always_usable_with_facts():
    st = sysinfo.cpu_status()
    assert st.name == "cpu"
    assert st.usable is True
    assert st.reason is None and st.hint is None
    assert st.details["brand"]
    assert int(st.details["cores_logical"]) == os.cpu_count()
    assert int(st.details["torch_threads"]) == torch.get_num_threads()
    assert all(isinstance(v, str) for v in st.details.values())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux-specific reason text")
def test_mps_unusable_on_linux_with_not_macos_reason():
    st = sysinfo.mps_status()
    assert st.name == "mps"
    assert st.usable is False
    assert st.reason == "this is Linux, not macOS; MPS needs an Apple-silicon Mac"
    assert st.hint
    assert st.details["built"] in ("yes", "no")
    assert "PYTORCH_ENABLE_MPS_FALLBACK" in st.details
    assert st.details["min_macos"] == "{}.{}".format(*sysinfo.mps_min_macos())


@pytest.mark.skipif(not ON_LINUX_NO_GPU, reason="needs a machine without CUDA")
def test_cuda_unusable_here_with_reason():
    st = sysinfo.cuda_status()
    assert st.usable is False
    assert st.reason and len(st.reason) > 20
    assert st.hint
    assert st.details["device_count"] == "0"
    if torch.version.cuda is None:
        assert "built without CUDA" in st.reason
    else:
        assert "is_available() is False" in st.reason or "CUDA_VISIBLE_DEVICES" in st.reason


def test_backend_status_dispatch():
    assert sysinfo.backend_status("cpu").name == "cpu"
    assert sysinfo.backend_status("mps").name == "mps"
    assert sysinfo.backend_status("cuda:1").name == "cuda"
    bad = sysinfo.backend_status("xpu")
    assert bad.usable is False and "xpu" in (bad.reason or "")


def test_software_versions_shape():
    sw = sysinfo.software_versions()
    assert set(sw) == {"torch", "torchvision", "mlflow", "python", "numpy"}
    assert sw["torch"] == torch.__version__
    assert sw["python"] == ".".join(map(str, sys.version_info[:3]))
    assert all(isinstance(v, str) and v for v in sw.values())


def test_software_versions_absent(monkeypatch):
    import importlib.metadata as md

    real = md.version

    def fake(name: str) -> str:
        if name.startswith("mlflow"):
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "version", fake)
    assert sysinfo.software_versions()["mlflow"] == "absent"


def test_run_tags_contract_and_fast():
    t0 = time.perf_counter()
    tags = sysinfo.run_tags(torch.device("cpu"))
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, f"run_tags took {elapsed:.3f}s"
    assert len(tags) >= 8
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items())
    for ns in ("device.", "cpu.", "sw."):
        assert any(k.startswith(ns) for k in tags), ns
    for key in (
        "device.type", "device.name", "cpu.brand", "cpu.cores_logical", "cpu.torch_threads",
        "cpu.arch", "mps.built", "mps.available", "cuda.available", "cuda.runtime",
        "cuda.device_count", "sw.torch", "sw.torchvision", "sw.mlflow", "sw.python",
        "sw.numpy", "os.platform", "torch.version", "python.version",
    ):
        assert key in tags, key
    assert tags["device.type"] == "cpu"
    assert tags["device.name"] == tags["cpu.brand"]
    assert tags["torch.version"] == tags["sw.torch"] == torch.__version__
    assert tags["python.version"] == tags["sw.python"]
    assert "device.index" not in tags


def test_run_tags_default_device_and_string_device():
    assert sysinfo.run_tags()["device.type"] in ("cpu", "mps", "cuda")
    assert sysinfo.run_tags("cpu")["device.type"] == "cpu"


def test_run_tags_never_raises(monkeypatch):
    def boom(*_a, **_k):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    monkeypatch.setattr(torch.cuda, "device_count", boom)
    monkeypatch.setattr(torch, "get_num_threads", boom)
    monkeypatch.setattr(sysinfo, "software_versions", boom)
    monkeypatch.setattr(host, "_machine", boom)
    tags = sysinfo.run_tags(torch.device("cuda:0"))
    assert tags["device.type"] == "cuda"
    assert tags["cpu.torch_threads"] == "unknown"
    assert tags["sw.torch"] == "unknown"
    assert all(isinstance(v, str) for v in tags.values())


def test_no_mlflow_import():
    """sysinfo/doctor must stay cheap: reading mlflow's version must not import it."""
    code = (
        "import sys; from mpsrun.devices import sysinfo, doctor; "
        "sysinfo.run_tags(); doctor.build_report(); "
        "assert 'mlflow' not in sys.modules, 'mlflow imported'"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------- doctor


def test_doctor_report_json_serialisable():
    report = doctor.build_report()
    again = json.loads(json.dumps(report))
    assert again == report
    assert set(report["backends"]) == {"cpu", "mps", "cuda"}
    for name, st in report["backends"].items():
        assert st["name"] == name
        assert isinstance(st["usable"], bool)
        assert st["usable"] or st["reason"]
    assert report["backends"]["cpu"]["usable"] is True
    assert report["recommended_device"] in ("cpu", "mps", "cuda")
    assert report["backends"][report["recommended_device"]]["usable"] is True
    if ON_LINUX_NO_GPU:
        assert report["recommended_device"] == "cpu"


def test_recommended_device_preference():
    u = {"usable": True}
    n = {"usable": False}
    assert doctor.recommended_device({"cpu": u, "mps": u, "cuda": u}) == "cuda"
    assert doctor.recommended_device({"cpu": u, "mps": u, "cuda": n}) == "mps"
    assert doctor.recommended_device({"cpu": u, "mps": n, "cuda": n}) == "cpu"
    assert doctor.recommended_device({}) == "cpu"


def test_doctor_survives_crashing_probe(monkeypatch):
    real = sysinfo.backend_status

    def flaky(name: str):
        if name == "cuda":
            raise RuntimeError("nvml went away")
        return real(name)

    monkeypatch.setattr(sysinfo, "backend_status", flaky)
    report = doctor.build_report()
    assert report["backends"]["cuda"]["usable"] is False
    assert "nvml went away" in report["backends"]["cuda"]["reason"]


def test_doctor_render_shows_marks_reasons_and_software():
    from rich.console import Console

    report = doctor.build_report()
    console = Console(record=True, width=120, color_system=None)
    doctor.render(report, console)
    out = console.export_text()
    assert "✓ cpu" in out
    for name, st in report["backends"].items():
        if not st["usable"]:
            assert f"✗ {name}" in out
            assert st["reason"].split()[0] in out
    assert "software" in out and torch.__version__ in out
    assert f"recommended device: {report['recommended_device']}" in out


# --------------------------------------------------------------------- simulated Mac


@pytest.fixture
def fake_mac(monkeypatch):
    """An Apple-silicon Mac on macOS 14.5 with an MPS-enabled torch; tests break one thing."""
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(host.platform, "mac_ver", lambda: ("14.5", ("", "", ""), "arm64"))
    monkeypatch.setattr(host, "_machine", lambda: "arm64")
    monkeypatch.setattr(host, "_is_rosetta", lambda: False)
    monkeypatch.setattr(host, "_mac_chip", lambda: "Apple M2 Max")
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    return monkeypatch


def test_mps_mock_usable(fake_mac):
    fake_mac.setenv("PYTORCH_ENABLE_MPS_FALLBACK", "1")
    st = sysinfo.mps_status()
    assert st.usable is True
    assert st.reason is None and st.hint is None
    assert st.details["macos"] == "14.5"
    assert st.details["min_macos"] == "14.0"
    assert st.details["built"] == "yes"
    assert st.details["available"] == "yes"
    assert st.details["rosetta"] == "no"
    assert st.details["chip"] == "Apple M2 Max"
    assert st.details["PYTORCH_ENABLE_MPS_FALLBACK"] == "1"


def test_mps_mock_not_built_reason(fake_mac):
    fake_mac.setattr(torch.backends.mps, "is_built", lambda: False)
    fake_mac.setattr(torch.backends.mps, "is_available", lambda: False)
    st = sysinfo.mps_status()
    assert st.usable is False
    assert st.reason == "this torch 2.9.1 was built without MPS support"
    assert "arm64" in st.hint


def test_mps_mock_rosetta_reason(fake_mac):
    fake_mac.setattr(host, "_is_rosetta", lambda: True)
    fake_mac.setattr(host, "_machine", lambda: "x86_64")
    st = sysinfo.mps_status()
    assert st.usable is False
    assert "Rosetta" in st.reason and "arm64" in st.reason
    assert st.details["rosetta"] == "yes"


def test_mps_mock_x86_python_reason(fake_mac):
    fake_mac.setattr(host, "_machine", lambda: "x86_64")
    st = sysinfo.mps_status()
    assert st.usable is False
    assert "x86_64" in st.reason and "Rosetta" not in st.reason


def test_mps_mock_old_macos_reason(fake_mac):
    fake_mac.setattr(host.platform, "mac_ver", lambda: ("13.6.1", ("", "", ""), "arm64"))
    fake_mac.setattr(torch.backends.mps, "is_available", lambda: False)
    st = sysinfo.mps_status()
    assert st.usable is False
    assert st.reason == "macOS 13.6.1 is older than 14.0, the minimum for MPS in torch 2.9.1"
    assert "torch<2.9" in st.hint  # the newest torch that still runs MPS on Ventura


def test_mps_mock_old_macos_for_older_torch(fake_mac):
    fake_mac.setattr(torch, "__version__", "2.6.0")
    fake_mac.setattr(host.platform, "mac_ver", lambda: ("12.7.6", ("", "", ""), "arm64"))
    fake_mac.setattr(torch.backends.mps, "is_available", lambda: False)
    st = sysinfo.mps_status()
    assert st.usable is False
    assert "older than 13.0" in st.reason
    assert "torch<2.5" in st.hint


def test_mps_mock_old_macos_but_torch_says_available(fake_mac):
    """torch is authoritative: a custom build on an older OS is not blocked by our table."""
    fake_mac.setattr(host.platform, "mac_ver", lambda: ("13.6", ("", "", ""), "arm64"))
    st = sysinfo.mps_status()
    assert st.usable is True
    assert "note" in st.details


def test_mps_mock_no_gpu_visible_reason(fake_mac):
    fake_mac.setattr(torch.backends.mps, "is_available", lambda: False)
    st = sysinfo.mps_status()
    assert st.usable is False
    assert "is_available() is False" in st.reason
    assert "sandbox" in st.hint


def test_mps_mock_reasons_are_distinct(fake_mac):
    reasons = set()
    for patch in (
        lambda m: m.setattr(torch.backends.mps, "is_built", lambda: False),
        lambda m: m.setattr(host, "_is_rosetta", lambda: True),
        lambda m: m.setattr(host.platform, "mac_ver", lambda: ("12.6", ("", "", ""), "")),
        lambda m: None,
    ):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch.backends.mps, "is_available", lambda: False)
            patch(m)
            reasons.add(sysinfo.mps_status().reason)
    assert len(reasons) == 4 and None not in reasons


def test_mps_mock_run_tags(fake_mac):
    tags = sysinfo.run_tags(torch.device("mps"))
    assert tags["device.type"] == "mps"
    assert tags["device.name"] == "Apple GPU (Apple M2 Max)"
    assert tags["mps.built"] == "yes" and tags["mps.available"] == "yes"
    assert tags["mps.macos"] == "14.5"
    assert all(isinstance(v, str) for v in tags.values())


def test_mps_min_macos_table():
    assert sysinfo.mps_min_macos("1.13.1") == (12, 3)
    assert sysinfo.mps_min_macos("2.4.1") == (12, 3)
    assert sysinfo.mps_min_macos("2.5.0") == (13, 0)
    assert sysinfo.mps_min_macos("2.8.0+cpu") == (13, 0)
    assert sysinfo.mps_min_macos("2.9.1+cu130") == (14, 0)
    assert sysinfo.mps_min_macos("2.11.0") == (14, 0)
    assert sysinfo.mps_min_macos("2.10.0.dev20251008") == (14, 0)


# --------------------------------------------------------------------- simulated CUDA


def test_cuda_mock_built_without_cuda_reason(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    st = sysinfo.cuda_status()
    assert st.usable is False
    assert "built without CUDA" in st.reason
    assert "download.pytorch.org" in st.hint


def test_cuda_mock_hidden_by_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    st = sysinfo.cuda_status()
    assert st.usable is False
    assert "CUDA_VISIBLE_DEVICES" in st.reason


def test_cuda_mock_old_driver_reason(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(backends, "_cuda_driver_version", lambda: "525.60.13")
    st = sysinfo.cuda_status()
    assert st.usable is False
    assert "525.60.13" in st.reason and "13.0" in st.reason


@pytest.fixture
def fake_cuda(monkeypatch):
    props = [
        SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 1024**3),
        SimpleNamespace(name="NVIDIA A10", major=8, minor=6, total_memory=24 * 1024**3),
    ]
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    monkeypatch.setattr(backends, "_cuda_driver_version", lambda: "570.86.15")
    return monkeypatch


def test_cuda_mock_usable_details(fake_cuda):
    st = sysinfo.cuda_status()
    assert st.usable is True and st.reason is None
    d = st.details
    assert d["device_count"] == "2"
    assert d["gpu0"] == "NVIDIA H100 80GB HBM3" and d["gpu0.capability"] == "9.0"
    assert d["gpu1.memory_gib"] == "24.0"
    assert d["driver"] == "570.86.15" and d["runtime"] == "12.8" and d["cudnn"] == "91002"


def test_cuda_mock_run_tags(fake_cuda):
    tags = sysinfo.run_tags(torch.device("cuda:1"))
    assert tags["device.type"] == "cuda"
    assert tags["device.index"] == "1"
    assert tags["device.name"] == "NVIDIA A10"
    assert tags["cuda.capability"] == "8.6"
    assert tags["cuda.memory_gib"] == "24.0"
    assert tags["cuda.driver"] == "570.86.15"
    assert tags["cuda.available"] == "yes" and tags["cuda.device_count"] == "2"
    assert tags["cuda.runtime"] == "12.8"
    assert sysinfo.run_tags(torch.device("cuda"))["device.index"] == "0"
    report = doctor.build_report()
    assert report["recommended_device"] == "cuda"
