"""A model's arithmetic: `exact` (stock mlx's fp32 sums: the default, token-identical to
mlx-lm) or `q8` (8-bit activations times the weights in integer dot products, kernels/q8.h).

q8 changes the model's results (about as much as a Q8_0 activation format does in GGUF's CPU
kernels) but not their independence from the batch: a token row's output is the same bits
for every number of rows in the GEMM and every position among them, so speculative decoding
on a q8 model gives exactly that q8 model's own autoregressive output. Every weight GEMM of
the model takes it (prefill, steps, verifies, the LM head); attention's GEMMs stay fp32.
A matrix's first q8 GEMM makes its packed copy for the vector kernel: a stored matrix's
about its stored size, an fp32 one as Q8_0 (one scale per 32 weights); a matrix only
gathered from (an untied embedding) never takes one.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx

from ..errors import ModelLoadError
from . import stored

ARITHMETICS = ("exact", "q8")
_WHY = {
    -1: "the router's table is full",
    -2: "no routed kernel",
    -3: "its rows are not whole blocks of its type",
    -4: "out of memory",
}


@dataclass
class Q8State:
    """The q8 matrices of one model: the arrays (kept alive while their stand-ins are
    registered, so no other array takes their addresses) and the bytes their packed copies
    take once made (0: no vector kernel; the reference runs)."""

    mode: str
    weights: list[Any] = field(default_factory=list)
    addresses: list[int] = field(default_factory=list)
    packed_bytes: int = 0
    vector: bool = False


def _gemm_weights(model: Any) -> list[tuple[mx.array, int, int, int, int]]:
    """(array, address, n, k, ld) of every 2-D weight a GEMM of `model` may read: stored
    matrices by their bytes, fp32 ones by their data."""
    from mlx.utils import tree_flatten

    out, seen = [], set()
    params = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    for _, a in params:
        if not isinstance(a, mx.array) or a.ndim != 2 or a.dtype != mx.float32:
            continue
        s = stored.lookup(a)
        if s is not None:
            addr, n, k = s.address, s.n, s.k
        else:
            addr, (n, k) = stored._address(a) or 0, a.shape
            if not addr or k % 32:
                continue
        if addr not in seen:
            seen.add(addr)
            out.append((a, addr, n, k, k))
    return out


def _lib() -> Any:
    lib = stored.router()
    if lib is None:
        raise ModelLoadError(
            "ADASPEC_ARITHMETIC=q8 needs adaspec's routed kernel; accepted: "
            "ADASPEC_ARITHMETIC=exact, or ADASPEC_BLAS=routed on an x86-64 CPU with AVX2"
        )
    lib.adaspec_q8_use.restype = ctypes.c_long
    return lib


def apply(model: Any, mode: str) -> Q8State | None:
    """Put every weight GEMM of `model` on `mode` (exact | q8); returns the state it keeps on
    the model (`model.adaspec_arithmetic`), None for exact on a model never set to q8."""
    if mode not in ARITHMETICS:
        raise ModelLoadError(f"arithmetic {mode!r} is unknown; accepted: {', '.join(ARITHMETICS)}")
    state: Q8State | None = getattr(model, "adaspec_arithmetic", None)
    if state is None and mode == "exact":
        return None
    lib = _lib()
    mx.synchronize()  # no GEMM in flight reads a flag or a copy while it changes
    if state is None:
        state = Q8State(mode)
        weakref.finalize(model, _release, lib, state.addresses, state.weights)
        model.adaspec_arithmetic = state
    on = int(mode == "q8")
    state.mode, state.packed_bytes = mode, 0
    for a, addr, n, k, ld in _gemm_weights(model):
        rc = lib.adaspec_q8_use(ctypes.c_void_p(addr), n, k, ld, on)
        if rc < 0:
            raise ModelLoadError(
                f"a {n}x{k} weight cannot take the q8 arithmetic ({_WHY.get(rc, rc)});"
                " accepted: ADASPEC_ARITHMETIC=exact"
            )
        if addr not in state.addresses and stored.lookup(a) is None:
            state.weights.append(a)  # an fp32 matrix: its stand-in is ours to remove
            state.addresses.append(addr)
        state.packed_bytes += rc
    state.vector = state.packed_bytes > 0
    return state


def _release(lib: Any, addresses: list[int], *keep: Any) -> None:
    mx.synchronize()
    for addr in addresses:
        lib.adaspec_shadow_remove(ctypes.c_void_p(addr))


def of(model: Any) -> str:
    """The arithmetic `model`'s GEMMs use."""
    state = getattr(model, "adaspec_arithmetic", None)
    return "exact" if state is None else state.mode


def describe(model: Any) -> str:
    """One line for reports: the arithmetic, and for q8 which kernel runs it."""
    state = getattr(model, "adaspec_arithmetic", None)
    if state is None or state.mode == "exact":
        return "exact"
    kernel = {2: "AVX-512 VNNI", 1: "AVX2"}.get(int(_lib().adaspec_q8_kernel()))
    if kernel is None:
        return "q8 (scalar reference)"
    return f"q8 ({kernel}, packed copies up to {state.packed_bytes / 1e6:.0f} MB)"


def calls() -> int | None:
    """GEMMs run in the q8 arithmetic so far in this process (None without the router)."""
    lib = stored.router()
    if lib is None:
        return None
    lib.adaspec_q8_calls.restype = ctypes.c_ulong
    return int(lib.adaspec_q8_calls())


def curves(model: Any, measure: Callable[[], list[dict]]) -> dict[str, Any]:
    """Per arithmetic this process can run (exact, and q8 with the routed kernel), `measure()`'s
    rows ({"tokens", "ms", "ratio"} per forward size) with `model` on it; the model is left on
    the arithmetic it had."""
    had = of(model)
    modes = ARITHMETICS if stored.router() is not None else (had,)
    out: dict[str, Any] = {}
    try:
        for mode in modes:
            apply(model, mode)
            rows = {r["tokens"]: {"ms": r["ms"], "ratio": r["ratio"]} for r in measure()}
            out[mode] = {"kernel": describe(model), "rows": rows}
    finally:
        apply(model, had)
    return out


def curve_lines(curves: dict[str, Any]) -> list[str]:
    """The row-cost curve of each arithmetic side by side (doctor's report)."""
    if len(curves) < 2:
        return []
    modes = list(curves)
    out = [
        "arithmetic    ms of a forward of n token rows (ratio to 1 row); "
        + "; ".join(f"{k}: {c['kernel']}" for k, c in curves.items()),
        "tokens " + "".join(f"{k:>18}" for k in modes),
    ]
    for n in curves[modes[0]]["rows"]:
        cells = "".join(
            f"{curves[k]['rows'][n]['ms']:9.1f} ({curves[k]['rows'][n]['ratio']:4.2f}x)"
            for k in modes
        )
        out.append(f"{n:6} {cells}")
    return out
