"""Per-device GPU readings through NVML (``nvidia-ml-py``), for the replicas' GPU gauges.

NVML is imported and opened lazily, once: where the package, the driver or a device is absent, ``read``
returns no readings and ``series`` none, so the GPU gauges (``deployments.metrics``) export no series at
all — a CPU node leaves the GPU board empty rather than showing zeros.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cluster import metrics as names

log = logging.getLogger("specserve.gpu_metrics")


@dataclass(frozen=True)
class GpuReading:
    index: int  # NVML device index on this node
    utilization: float  # 0..1 over NVML's last sample period
    memory_used: int  # bytes
    memory_total: int  # bytes
    sm_clock_hz: float


class NvmlReader:
    def __init__(self):
        self._nvml = None
        self._handles: list | None = None  # None: not opened yet; []: no NVML or no device

    def _open(self) -> list:
        if self._handles is None:
            self._handles = []
            try:
                import pynvml
            except ImportError:
                return self._handles
            try:
                pynvml.nvmlInit()
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
                self._nvml = pynvml
            except pynvml.NVMLError as exc:  # no driver / no device: a CPU node
                log.debug("NVML unavailable: %s", exc)
        return self._handles

    def read(self) -> list[GpuReading]:
        out = []
        for i, handle in enumerate(self._open()):
            nvml = self._nvml
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(GpuReading(
                index=i, utilization=nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
                memory_used=int(mem.used), memory_total=int(mem.total),
                sm_clock_hz=nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM) * 1e6))
        return out


def series(readings: list[GpuReading]) -> list[tuple[str, float, dict[str, str]]]:
    """(metric name, value, tags) per GPU gauge and device."""
    out = []
    for r in readings:
        tags = {"gpu": str(r.index)}
        out += [(names.GPU_UTILIZATION, r.utilization, tags), (names.GPU_MEMORY_USED, float(r.memory_used), tags),
                (names.GPU_MEMORY_TOTAL, float(r.memory_total), tags), (names.GPU_SM_CLOCK, r.sm_clock_hz, tags)]
    return out
