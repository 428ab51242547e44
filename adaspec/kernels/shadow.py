"""bf16 shadows: half-size copies of a drafter's fp32 weight matrices that the routed kernel
reads in their place.

Decoding on this CPU streams every weight once per token, so a draft token's cost is its
model's bytes. A shadow is a bf16 copy (round to nearest even) of one fp32 matrix, registered
with the router (blas_route.c) by the matrix's address, shape and stride: a small-M GEMM on
exactly that matrix reads the copy and widens it to fp32 in registers; every other GEMM, a
prefill on the BLAS library included, reads the fp32 data. The results differ from fp32 by
bf16's rounding of the weights, which costs a drafter a little acceptance and the output
nothing: the target, which is never shadowed, verifies every token.

A `Shadows` keeps the fp32 arrays it shadows alive while registered, so no other array can
take their addresses and read a copy meant for them.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import DrafterError
from ..settings import WEIGHT_CHOICES
from . import blas, stored

Q8_VNNI = 2  # adaspec_q8_kernel(): the q8 kernel's AVX-512 VNNI form (1: AVX2, 0: none)


def resolve(weights: str, who: str, accepted: tuple[str, ...] = WEIGHT_CHOICES) -> str:
    """A drafter's `weights=` value (one of `accepted`) -> fp32 | bf16 | q8 | q4 (auto: q4
    where `accepted` has it, else q8, where the routed kernel has its AVX-512 VNNI form; else
    bf16 where the routed kernel runs). q8: the drafter's own GEMMs in the 8-bit arithmetic
    (kernels/arithmetic.py); q4: as q8, on 4-bit copies of a GGUF model's wider weights
    (kernels/requant.py); a drafter's arithmetic never changes what is emitted, only how much
    its drafts cost and how often they are accepted."""
    if weights not in accepted:
        raise DrafterError(f"{who} weights={weights!r} is invalid; accepted: {', '.join(accepted)}")
    if weights != "auto":
        return weights
    router = _routed_kernel()
    if router is None:
        return "fp32"
    router.adaspec_q8_kernel.restype = ctypes.c_int
    if router.adaspec_q8_kernel() != Q8_VNNI:
        return "bf16"
    return "q4" if "q4" in accepted else "q8"


def to_bf16(w: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits (uint16), rounded to nearest, ties to even; NaN stays NaN."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(w)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def from_bf16(h: np.ndarray) -> np.ndarray:
    """bf16 bits -> the fp32 values they stand for (exact)."""
    return (h.astype(np.uint32) << 16).view(np.float32)


def _routed_kernel() -> Any:
    """The router when its kernels run this process's small GEMMs (what reads shadows)."""
    router = getattr(blas, "_router", None)
    status = blas.status()
    routed = status is not None and status.kind == blas.ROUTED and blas.kernel_isa()
    return router if routed else None


def _router() -> Any:
    router = _routed_kernel()
    if router is None:
        status = blas.status()
        kind = status.kind if status is not None else None
        raise DrafterError(
            f"weights=bf16 needs adaspec's routed kernel (BLAS in use: {kind or 'none'}); "
            "accepted: weights=fp32, or ADASPEC_BLAS=routed (the default) on an x86-64 CPU with "
            "AVX2 and a C compiler"
        )
    return router


def _view(a: Any) -> np.ndarray:
    """The fp32 matrix's own memory (no copy)."""
    return np.asarray(memoryview(a))


def _unregister(router: Any, addresses: list[int], *keep: Any) -> None:
    """Remove the shadows; `keep` (the arrays and their copies) lives until this has run."""
    for addr in addresses:
        router.adaspec_shadow_remove(ctypes.c_void_p(addr))


class Shadows:
    """bf16 shadows of 2-D fp32 arrays, registered until `close()` (or garbage collection)."""

    def __init__(self, arrays: Iterable[Any]):
        import mlx.core as mx

        router = _router()
        self._arrays: list[Any] = []  # keeps the fp32 addresses taken
        self._copies: list[np.ndarray] = []
        addresses: list[int] = []
        self._done = weakref.finalize(
            self, _unregister, router, addresses, self._arrays, self._copies
        )
        for a in arrays:
            if a.ndim != 2 or a.dtype != mx.float32 or stored.lookup(a) is not None:
                continue  # a stored weight is read at its own (fewer) bits already
            mx.eval(a)
            view = _view(a)
            if not view.flags["C_CONTIGUOUS"]:
                continue
            copy = to_bf16(view)
            addr = view.ctypes.data
            rc = router.adaspec_shadow_add(
                ctypes.c_void_p(addr),
                ctypes.c_int(view.shape[0]),
                ctypes.c_int(view.shape[1]),
                ctypes.c_int(view.shape[1]),
                ctypes.c_void_p(copy.ctypes.data),
            )
            if rc != 1:
                self.close()
                why = {0: "the router's table is full", -1: "it already has a shadow"}
                raise DrafterError(
                    f"weights=bf16: a {view.shape[0]}x{view.shape[1]} matrix could not be "
                    f"shadowed ({why.get(rc, f'code {rc}')}); accepted: weights=fp32"
                )
            self._arrays.append(a)
            self._copies.append(copy)
            addresses.append(addr)
        self.addresses = addresses

    @property
    def count(self) -> int:
        return len(self._copies)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._copies)

    def close(self) -> None:
        self._done()


def shadow_model(model: Any) -> Shadows:
    """Shadows of every 2-D fp32 parameter of `model` (its linear layers and a tied output
    projection). Only for a model of the drafter's own: shadowing weights the target shares
    would make the target read the copies too."""
    from mlx.utils import tree_flatten

    params: Any = tree_flatten(model.parameters())
    return Shadows(a for _, a in params)


def shadow_calls() -> int | None:
    """Routed GEMMs that read a shadow so far; None without the router."""
    router = getattr(blas, "_router", None)
    if router is None:
        return None
    router.adaspec_shadow_calls.restype = ctypes.c_ulong
    return int(router.adaspec_shadow_calls())
