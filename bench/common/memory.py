"""The peak-memory probe the benches share: /proc status fields, the kernel's peak-RSS reset, CUDA's peak."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The kB fields of /proc/PID/status (VmRSS, VmHWM, RssAnon, RssShmem, ...) in bytes; empty once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in lines if line.endswith(" kB"))
    return {key: int(value.split()[0]) * 1024 for key, value in fields}


def reset_peak_rss() -> bool:
    """Start a new peak RSS: the kernel's VmHWM reset to the RSS now (False where refused: it counts from the start)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def reset_peak_memory() -> None:
    """Start a new peak: CUDA allocator stats on GPU, the kernel's peak RSS (VmHWM) on CPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()


def memory_mib() -> tuple[float, float]:
    """(current, peak since the last reset) in MiB: allocated CUDA memory on GPU, resident memory on CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2**20, torch.cuda.max_memory_allocated() / 2**20
    status = proc_status()
    return status["VmRSS"] / 2**20, status["VmHWM"] / 2**20


def peak_rss_gib() -> dict[str, float]:
    """VmHWM (peak RSS) of this process and of each live descendant (an engine core, a rank), in GiB."""
    import psutil

    peaks = {"bench process": proc_status(os.getpid()).get("VmHWM", 0) / 2**30}
    for child in psutil.Process().children(recursive=True):
        try:
            peaks[f"{child.name()} ({child.pid})"] = proc_status(child.pid).get("VmHWM", 0) / 2**30
        except psutil.Error:
            pass
    return peaks


class PeakMeter:
    """The peak of this process's tensors from `start()` to `stop()`: allocated CUDA memory on GPU; on CPU the
    resident set (the kernel's high-water mark after a reset, or a 5 ms sampler where the reset is refused)."""

    def __init__(self, on_gpu: bool) -> None:
        self.on_gpu = on_gpu
        self._sampled = 0
        self._running = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif not reset_peak_rss():
            self._running = True
            self._sampled = proc_status()["VmRSS"]
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while self._running:
            self._sampled = max(self._sampled, proc_status()["VmRSS"])
            time.sleep(0.005)

    def stop(self) -> int:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        if self._thread is not None:
            self._running = False
            self._thread.join()
            return self._sampled
        return proc_status()["VmHWM"]


def pickle_by_value_for_ray() -> None:
    """Ray ships this module's probes by value: a rank's process (`__ray_call__`) need not find bench on its path."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
