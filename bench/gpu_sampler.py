"""The GPU's clock, draw and throttle reasons read through nvidia-smi while a benchmark runs, for figures taken
under a power cap (benchmarks/power_cap_probe.py, benchmarks/peer_inputs.py)."""

from __future__ import annotations

import logging
import statistics
import subprocess
import threading
import time

import torch

logger = logging.getLogger(__name__)

SAMPLE_FIELDS = ("clocks.sm", "power.draw", "clocks_event_reasons.active")


def nvidia_smi_id(device: torch.device) -> str:
    """nvidia-smi's name for torch's `device`: its UUID (nvidia-smi numbers GPUs by PCI order and ignores
    CUDA_VISIBLE_DEVICES, so an index could name another GPU)."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def nvidia_smi_query(gpu: str, fields: tuple[str, ...]) -> list[str]:
    """One nvidia-smi reading of `fields` for `gpu`, as the strings it prints (units dropped)."""
    text = subprocess.run(["nvidia-smi", "-i", gpu, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=True, timeout=10).stdout
    values = [v.strip() for v in text.splitlines()[0].split(",")]
    if len(values) != len(fields):
        raise RuntimeError(f"nvidia-smi gave {values} for {fields}")
    return values


def spread(values: list[float]) -> list[float]:
    """[min, median, max]."""
    return [min(values), statistics.median(values), max(values)]


class GpuSampler:
    """Reads the SM clock, the draw and the clock-event reasons every `period_s` on a thread while in use, as
    (time, MHz, W, reasons); a reading that fails is counted and logged, not taken."""

    def __init__(self, gpu: str, period_s: float = 0.2) -> None:
        self.gpu = gpu
        self.period_s = period_s
        self.samples: list[tuple[float, float, float, str]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            at = time.perf_counter()
            try:
                clock, draw, reasons = nvidia_smi_query(self.gpu, SAMPLE_FIELDS)
                self.samples.append((at, float(clock), float(draw), reasons))
            except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as exc:
                self.errors += 1
                logger.warning("nvidia-smi reading failed: %s", exc)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
