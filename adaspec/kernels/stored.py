"""Weights read at their stored bits: a GGUF model's quantized blocks (and 2-byte floats) stay
as the file stores them, and the routed kernel widens them in registers to exactly the fp32
values of their expansion.

A decode step on this CPU streams every weight once, so its cost is the bytes the weights
take: Q4_1 is 5/32 of fp32's. A stored matrix is an mlx array holding the bytes, and the
weight the model sees is a view of those bytes with the fp32 matrix's shape (mx.as_strided,
no copy, never read by mlx itself). The router (blas_route.c) knows the view's address: every
GEMM on it reads the blocks, the kernel for up to 32 token rows, the BLAS library on widened
tiles for a prefill. The embedding is gathered from the blocks (`StoredEmbedding`). Results
are bit-identical to the fp32 expansion's (tests/test_stored.py), so mlx-lm's own decoding in
the same process reads the same weights and gives the same tokens.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ModelLoadError
from . import blas

# GGUF tensor types the kernel reads as stored -> (GGML type id, elements, bytes per block)
TYPES = {
    "F16": (1, 1, 2),
    "BF16": (30, 1, 2),
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
WHY = {0: "the router's table is full", -1: "it is registered already", -2: "no kernel"}


def router() -> Any:
    """The router when its kernels run this process's GEMMs (what reads stored bits)."""
    status = blas.status()
    routed = status is not None and status.kind == blas.ROUTED and blas.kernel_isa()
    return getattr(blas, "_router", None) if routed else None


def readable(type_name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this GGUF type and (rows, K) shape can be read as stored."""
    return type_name in TYPES and len(shape) == 2 and shape[1] % 32 == 0


def row_bytes(type_name: str, k: int) -> int:
    _, elems, size = TYPES[type_name]
    return k // elems * size


def _rows(type_name: str, raw: np.ndarray, k: int) -> np.ndarray:
    """`raw` as contiguous uint8 rows of k values of `type_name`; a wrong width is an error."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] != row_bytes(type_name, k):
        raise ValueError(f"{type_name} rows of {k} values take {row_bytes(type_name, k)} bytes")
    return raw


def values(type_name: str, raw: np.ndarray, k: int, *, vector: bool = True) -> np.ndarray:
    """The fp32 values of stored rows `raw` (uint8, rows x row_bytes): the kernel's widening
    (vector) or the reference (one scalar operation per numpy operation of the converter)."""
    lib = getattr(blas, "_router", None)
    if lib is None:
        raise ModelLoadError("stored weights need adaspec's routed kernel (ADASPEC_BLAS=routed)")
    raw = _rows(type_name, raw, k)
    out = np.empty((raw.shape[0], k), np.float32)
    lib.adaspec_stored_values(
        ctypes.c_int(int(vector)),
        ctypes.c_int(TYPES[type_name][0]),
        ctypes.c_void_p(raw.ctypes.data),
        ctypes.c_int(raw.shape[0]),
        ctypes.c_int(k),
        ctypes.c_long(raw.shape[1]),
        ctypes.c_void_p(out.ctypes.data),
    )
    return out


def type_stats() -> dict[str, tuple[int, float, int]]:
    """Per stored type, the kernel's GEMMs on matrices of that type so far: (calls, seconds,
    bytes of the matrices read); empty without the router."""
    lib = router()
    if lib is None:
        return {}
    out = (ctypes.c_ulong * 3)()
    stats = {}
    for name, (code, _, _) in TYPES.items():
        lib.adaspec_stored_type_stats(ctypes.c_int(code), out)
        stats[name] = (int(out[0]), out[1] / 1e9, int(out[2]))
    return stats


@dataclass
class Stored:
    """One matrix at its stored bits: `bytes_` (mlx memory) and `weight`, the (n, k) fp32
    view of those bytes that the model's layer holds and the router reads through."""

    type_name: str
    n: int
    k: int
    bytes_: mx.array
    weight: mx.array
    raw: np.ndarray  # the same bytes as numpy rows, for gathers

    @property
    def address(self) -> int:
        return int(self.raw.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)


def make(type_name: str, raw: np.ndarray, k: int) -> Stored:
    """A Stored matrix over a copy of `raw` (uint8 rows) in mlx memory; not yet registered."""
    raw = _rows(type_name, raw, k)
    n = raw.shape[0]
    flat = raw.reshape(-1)
    pad = -flat.size % 4
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, np.uint8)])
    bytes_ = mx.array(flat.view(np.float32))
    weight = mx.as_strided(bytes_, (n, k), (k, 1))
    mx.eval(bytes_, weight)
    view = np.asarray(_buffer(bytes_)).view(np.uint8)[: raw.size].reshape(raw.shape)
    return Stored(type_name, n, k, bytes_, weight, view)


def _unregister(lib: Any, addresses: list[int], *keep: Any) -> None:
    """Unregister once no computation in flight can still read the bytes (an async eval of
    the model's next step may be running when the model is dropped)."""
    mx.synchronize()
    for addr in addresses:
        lib.adaspec_shadow_remove(ctypes.c_void_p(addr))
        _BY_ADDRESS.pop(addr, None)


class Registry:
    """The stored matrices of one model, registered with the router while the model lives
    (attach it to the model: `model.adaspec_stored = registry`)."""

    def __init__(self) -> None:
        self.lib = router()
        if self.lib is None:
            raise ModelLoadError(
                "stored weights need adaspec's routed kernel (BLAS in use: "
                f"{getattr(blas.status(), 'kind', None) or 'none'}); accepted: "
                "ADASPEC_STORED_WEIGHTS=off, or ADASPEC_BLAS=routed on an x86-64 CPU with AVX2"
            )
        self.matrices: list[Stored] = []
        self._addresses: list[int] = []
        self._done = weakref.finalize(self, _unregister, self.lib, self._addresses, self.matrices)
        self._done.atexit = False  # at exit mlx may still be computing with these weights

    def add(self, s: Stored) -> Stored:
        rc = self.lib.adaspec_stored_add(
            ctypes.c_void_p(s.address),
            ctypes.c_int(TYPES[s.type_name][0]),
            ctypes.c_int(s.n),
            ctypes.c_int(s.k),
        )
        if rc != 1:
            raise ModelLoadError(
                f"a {s.n}x{s.k} {s.type_name} weight could not be read as stored "
                f"({WHY.get(rc, f'code {rc}')}); accepted: ADASPEC_STORED_WEIGHTS=off"
            )
        self.matrices.append(s)
        self._addresses.append(s.address)
        _BY_ADDRESS[s.address] = weakref.ref(s)
        return s

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.matrices)

    def drop_unused(self, model: Any) -> int:
        """Unregister and release the matrices `model` no longer holds (the layers a pipeline
        rank leaves to the others); returns the bytes released."""
        from mlx.utils import tree_flatten

        held = {id(p) for p in dict(tree_flatten(model.parameters())).values()}
        gone = [s for s in self.matrices if id(s.weight) not in held]
        if gone:
            _unregister(self.lib, [s.address for s in gone])
            addresses = {s.address for s in gone}  # in place: the finalizer holds the lists
            self.matrices[:] = [s for s in self.matrices if s.address not in addresses]
            self._addresses[:] = [a for a in self._addresses if a not in addresses]
        return sum(s.nbytes for s in gone)

    def close(self) -> None:
        self._done()


# address of a stored matrix's bytes -> the matrix (weak), to recognise its fp32 view
_BY_ADDRESS: dict[int, weakref.ref] = {}


def _buffer(a: mx.array) -> memoryview:
    """`a`'s memory, no copy (mx.array has the buffer protocol; its type stubs do not say)."""
    return memoryview(a)  # type: ignore[arg-type]


def _address(a: mx.array) -> int | None:
    try:
        return int(np.asarray(_buffer(a)).ctypes.data)
    except (TypeError, ValueError, BufferError):
        return None


def lookup(a: Any) -> Stored | None:
    """The Stored matrix whose fp32 view `a` is, else None (reads no data)."""
    if not isinstance(a, mx.array) or a.ndim != 2 or a.dtype != mx.float32:
        return None
    ref = _BY_ADDRESS.get(_address(a) or 0)
    s = ref() if ref is not None else None
    return s if s is not None and s.weight.shape == a.shape else None


def dense(a: Any) -> Any:
    """`a` with its values in memory: a stored weight's fp32 expansion (a new array, for code
    that reads a weight other than through a GEMM, e.g. training); any other array as it is."""
    s = lookup(a)
    return a if s is None else mx.array(values(s.type_name, s.raw, s.k))


def take_rows(weight: mx.array, ids: np.ndarray) -> tuple[mx.array, Registry | None]:
    """(weight[ids] as an array of its own, what keeps it readable): for a stored weight the
    kept rows stay stored, registered in a Registry the caller holds as long as it uses them."""
    s = lookup(weight)
    if s is None:
        return weight[mx.array(ids.astype(np.int32))], None
    reg = Registry()
    kept = reg.add(make(s.type_name, s.raw[ids], s.k))
    return kept.weight, reg


_ID_TYPES = (mx.int32, mx.uint32, mx.int64)


class StoredEmbedding(nn.Embedding):
    """An embedding whose table is stored: a lookup widens the gathered rows (the same values
    as the fp32 table's rows); `as_linear` (a tied output head) is a GEMM the router serves."""

    def __init__(self, stored: Stored):
        super().__init__(stored.n, stored.k)
        self.weight = stored.weight
        self._stored = stored

    def __call__(self, x: mx.array) -> mx.array:
        """The rows of token ids x (any shape), widened. On the native extension a lazy graph
        node (the ids need not be computed yet: mlx-lm's next step is built while this one
        runs; an id out of range fails at evaluation); else gathered at once in numpy."""
        from . import native

        st = self._stored
        core = native.get() if isinstance(x, mx.array) and x.dtype in _ID_TYPES else None
        if core is not None:
            return core.stored_rows(
                x, st.bytes_, TYPES[st.type_name][0], st.n, st.k, st.raw.shape[1]
            )
        ids = np.asarray(x, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self._stored.n):
            raise IndexError(f"token id out of range 0..{self._stored.n - 1}")
        rows = values(self._stored.type_name, self._stored.raw[ids.reshape(-1)], self._stored.k)
        return mx.array(rows.reshape(*ids.shape, self._stored.k))
