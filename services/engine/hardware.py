"""What an engine runs on: CPU model, cores, memory, and, when NVIDIA GPUs are
present and nvidia-ml-py is installed (the `gpu` extra), each GPU's memory, ECC
error counts and driver. Read from /proc and NVML; no subprocess."""

from __future__ import annotations

import os
from pathlib import Path

from llmesh.types import Gpu, Hardware


def parse_cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model"):
            return value.strip()
    return "unknown"


def parse_meminfo(meminfo: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    values = {}
    for line in meminfo.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values.get("MemTotal", 0), values.get("MemAvailable", 0)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def nvidia_gpus() -> tuple[Gpu, ...]:
    try:
        import pynvml  # nvidia-ml-py; only on GPU nodes
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return ()
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                corrected = pynvml.nvmlDeviceGetTotalEccErrors(
                    handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)
                uncorrected = pynvml.nvmlDeviceGetTotalEccErrors(
                    handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
            except pynvml.NVMLError:  # ECC off or unsupported on this board
                corrected = uncorrected = 0
            gpus.append(Gpu(pynvml.nvmlDeviceGetName(handle), mem.total, mem.used, corrected, uncorrected,
                            driver))
        return tuple(gpus)
    finally:
        pynvml.nvmlShutdown()


def probe() -> Hardware:
    total, available = parse_meminfo(_read("/proc/meminfo"))
    return Hardware(cpu_model=parse_cpu_model(_read("/proc/cpuinfo")), cpu_cores=os.cpu_count() or 0,
                    memory_total_bytes=total, memory_available_bytes=available, gpus=nvidia_gpus())


def replica_gpus(backend: str, tensor_parallel_size: int, gpus_here: int) -> int:
    """GPUs one replica spans on an engine, as placement must ask for them: vLLM on GPUs runs a
    model over its ``tensor_parallel_size`` of them; other backends, and vLLM's CPU build (no
    GPUs here), do not fix it (0)."""
    return tensor_parallel_size if backend == "vllm" and gpus_here else 0
