"""The machine a bench ran on, as `adaspec doctor` measures it: peak fp32 GFLOP/s (a loop of
independent FMAs on every core) and GB/s read (a read-only sum over arrays far larger than the
caches), plus the CPU's name, the cores and the load average at the start and end of the run.

Where adaspec stands against llama.cpp moves with these: adaspec's exact kernels do one fp32
FMA per weight and token row, so their rate follows the FMA peak; llama.cpp's 8-bit dot
products are bound by memory sooner. A bench's JSON carries them (`config.machine`), so a
figure is only held against one measured on the same machine."""

from __future__ import annotations

import os
from typing import Any


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def load() -> float:
    """The 1-minute load average (-1 where the system has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def measure(settings: Any = None) -> dict:
    """The roofline limits `adaspec doctor` reports, the CPU and the load now."""
    from ..kernels import roofline
    from ..settings import get

    settings = settings or get()
    cores = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {"cpu": cpu_name(), "cores": cores, "load_start": load()}
    try:
        lim = roofline.measure(settings.cache, threads=cores)
    except OSError as exc:
        return {**out, "error": str(exc)}
    out.update(peak_gflops=round(lim.peak_gflops, 1), read_gbs=round(lim.read_gbs, 1))
    return out


def line(machine: dict) -> str:
    """One line for the CLI: the limits and the load over the run."""
    if "peak_gflops" not in machine:
        return f"machine: {machine.get('cpu')}, limits not measured: {machine.get('error')}"
    return (
        f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['peak_gflops']:.0f} "
        f"fp32 GFLOP/s peak, {machine['read_gbs']:.0f} GB/s read (adaspec doctor's roofline); "
        f"load {machine['load_start']} at the start, {machine.get('load_end', '?')} at the end"
    )
