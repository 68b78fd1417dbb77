"""System metrics during the run: MLflow's own monitor, plus MPS memory from torch.mps.

MLflow's `SystemMetricsMonitor` samples CPU, memory, disk, network and (through
pynvml, from the `nvidia-ml-py` package) each NVIDIA GPU's utilisation and memory,
and logs them as `system/...` metrics, which the UI's System metrics tab draws.
It knows nothing of Apple GPUs, so on MPS a small monitor of ours adds
`system/mps_allocated_memory_megabytes` and `system/mps_driver_memory_megabytes`
from `torch.mps` (what the MPS allocator holds, and what Metal's driver holds for
the process).

Its default interval is 10 s, longer than a whole digits run; the interval here
is short (1 s by default, `MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` still wins),
so short runs get a curve too. The monitor runs on a daemon thread and writes in
batches; it never touches the training loop.
"""

from __future__ import annotations

import logging
from typing import Any

DEFAULT_INTERVAL_S = 1.0


def _mps_monitor_class() -> type:
    from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor

    class MPSMonitor(BaseMetricsMonitor):
        """Allocated and driver memory of the MPS backend, in MiB, averaged per logging step."""

        def collect_metrics(self) -> None:
            import torch

            self._metrics["mps_allocated_memory_megabytes"].append(torch.mps.current_allocated_memory() / 2**20)
            self._metrics["mps_driver_memory_megabytes"].append(torch.mps.driver_allocated_memory() / 2**20)

        def aggregate_metrics(self) -> dict[str, float]:
            return {k: round(sum(v) / len(v), 1) for k, v in self._metrics.items() if v}

    return MPSMonitor


def mps_monitor() -> Any:
    """A monitor of torch.mps memory (MLflow's BaseMetricsMonitor interface)."""
    return _mps_monitor_class()()


class SystemMetrics:
    """Start MLflow's monitor for a run (and ours on MPS); `stop` flushes what it sampled."""

    def __init__(self, uri: str, run_id: str, device_type: str, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.uri = uri
        self.run_id = run_id
        self.device_type = device_type
        self.interval_s = interval_s
        self.monitor: Any = None
        self.notes: list[str] = []

    def start(self) -> "SystemMetrics":
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # MLflow warns (once, on its logger) when pynvml is absent; on a machine without
            # an NVIDIA GPU that is not news, so only a CUDA run reports it (as a note).
            logging.getLogger("mlflow.system_metrics").setLevel(logging.ERROR)
            m = SystemMetricsMonitor(self.run_id, sampling_interval=self.interval_s, tracking_uri=self.uri)
            names = {type(x).__name__ for x in m.monitors}
            if self.device_type == "cuda" and "GPUMonitor" not in names:
                self.notes.append("system metrics: no NVIDIA GPU monitor (pynvml/nvidia-ml-py missing or NVML failed); GPU utilisation not recorded")
            if self.device_type == "mps":
                m.monitors.append(mps_monitor())
            m.start()
            self.monitor = m
        except Exception as e:  # system metrics are a nicety: the run goes on without them, said so
            self.notes.append(f"system metrics: monitor did not start ({type(e).__name__}: {e})")
        return self

    def stop(self) -> None:
        """Stop sampling and write what is buffered (before the run is marked terminated)."""
        m, self.monitor = self.monitor, None
        if m is None:
            return
        m.finish()
        # MLflow's loop drops the sample taken before its last wait, so a run shorter than
        # the interval would have none: publish what the monitors still hold.
        try:
            last = m.aggregate_metrics()
            if last:
                m.publish_metrics(last)
                m.mlflow_logger.flush()
        except Exception as e:
            self.notes.append(f"system metrics: last sample not written ({type(e).__name__}: {e})")
