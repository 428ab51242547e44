"""This machine's limits (memory bandwidth, peak fp32 FMA rate; roofline.c) and what a forward
of a model asks of them: the weight bytes it streams and the flops it does per token row."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .blas import ROOFLINE_SOURCE, build_library


@dataclass(frozen=True)
class Limits:
    threads: int
    triad_gbs: float  # STREAM-like triad a = b + s c, 12 bytes per element
    read_gbs: float  # a read-only sum: how a forward streams its weights
    peak_gflops: float  # fp32, 256-bit FMAs on every thread (-1: no AVX2/FMA)


def measure(cache: Path, threads: int = 2, floats: int = 1 << 25) -> Limits:
    """Best of 5 passes over arrays of `floats` floats (128 MB each by default), and a peak
    FMA loop; raises OSError when roofline.c cannot be built."""
    lib = ctypes.CDLL(str(build_library(ROOFLINE_SOURCE, cache)))
    lib.adaspec_stream_gbs.restype = ctypes.c_double
    lib.adaspec_stream_gbs.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_int]
    lib.adaspec_peak_gflops.restype = ctypes.c_double
    lib.adaspec_peak_gflops.argtypes = [ctypes.c_int, ctypes.c_long]
    triad = lib.adaspec_stream_gbs(0, floats, threads, 5)
    read = lib.adaspec_stream_gbs(1, floats, threads, 5)
    return Limits(threads, triad, read, lib.adaspec_peak_gflops(threads, 20_000_000))


def weight_traffic(model: Any) -> tuple[int, int]:
    """(bytes of weights one forward streams, their elements): every matrix, except an input
    embedding that is only gathered (a model with its own lm_head); a matrix read at its
    stored bits (kernels/stored.py) counts those bytes, the rest 4 bytes an element."""
    from mlx.utils import tree_flatten

    from .stored import lookup

    params = dict(tree_flatten(model.parameters()))
    untied = any(k.endswith("lm_head.weight") for k in params)
    nbytes = elements = 0
    for name, p in params.items():
        if p.ndim < 2 or (untied and "embed_tokens" in name):
            continue
        s = lookup(p)
        nbytes += s.nbytes if s is not None else p.nbytes
        elements += p.size
    return nbytes, elements


def rows(
    ms: dict[int, float], nbytes: int, elements: int, gemm_ms: dict[int, float] | None = None
) -> list[dict[str, Any]]:
    """Per token-row count M: ms per forward, its ratio to M = 1, the GFLOP/s of the weight
    matmuls (2 flops per weight element and row), the GB/s of weights streamed, and the ms
    of the forward spent inside GEMMs (None when not measured)."""
    base = ms[min(ms)]
    return [
        {
            "tokens": m,
            "ms": t,
            "ratio": t / base,
            "gflops": 2 * elements * m / t / 1e6,
            "weights_gbs": nbytes / t / 1e6,
            "gemm_ms": None if gemm_ms is None else gemm_ms.get(m),
        }
        for m, t in sorted(ms.items())
    ]


def by_type(run: Any, repeats: int, read_gbs: float | None = None) -> list[dict[str, Any]]:
    """Per weight type read at its stored bits, what `run` (one forward) spends in the
    kernel's GEMMs on that type, over `repeats` runs: MB read per run, ms per run, GB/s, and
    with `read_gbs` (the machine's read bandwidth) the ratio of that time to streaming the
    same bytes once at it (1.0: the memory floor)."""
    from .stored import type_stats

    before = type_stats()
    for _ in range(repeats):
        run()
    after = type_stats()
    out = []
    for name, (calls, secs, nbytes) in after.items():
        calls -= before[name][0]
        if calls <= 0:
            continue
        secs, nbytes = secs - before[name][1], nbytes - before[name][2]
        ms, mb = secs * 1e3 / repeats, nbytes / 1e6 / repeats
        row = {"type": name, "mb": mb, "ms": ms, "gbs": nbytes / secs / 1e9 if secs else 0.0}
        row["floor_ratio"] = floor_ratio(row, read_gbs) if read_gbs else None
        out.append(row)
    return sorted(out, key=lambda r: -r["ms"])


def floor_ratio(row: dict[str, Any], read_gbs: float) -> float:
    """A `by_type` row's time against streaming its bytes once at `read_gbs` (1.0: the floor)."""
    return float(row["ms"] / (row["mb"] / read_gbs))
