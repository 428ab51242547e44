"""4-bit copies of a model's wider stored weights, for a drafter: a draft token costs what its
model's weights take to stream, and a drafter's arithmetic never changes what is emitted (the
target verifies every token), only how often its drafts are accepted.

`requantize(model)` replaces each stored matrix of more than 5 bits a weight (Q8_0, Q5_*,
Q6_K, F16, BF16) with a Q4_1 copy of its values (per 32 weights: a half-precision step and
minimum, 4 bits a weight: 20 bytes where Q8_0 takes 34), the embedding's gathers included, and
releases the originals. The model's GEMMs then read the copies like any stored Q4_1 matrix.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from ..errors import ModelLoadError
from . import stored

KEPT = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K"}  # <= 5.5 bits a weight
CHUNK = 4096  # rows converted at a time (bounds the fp32 temporaries)


def q4_1(values: np.ndarray) -> np.ndarray:
    """fp32 rows [n, k] (k a multiple of 32) -> Q4_1 rows (uint8 [n, k / 32 * 20]): per block
    of 32 values the half-precision minimum m and step d = (max - min) / 15, and each value's
    nearest code q in 0..15 (its value d * q + m), two codes a byte (element j in the low
    nibble of byte j, element j + 16 in the high one), GGUF's layout."""
    n, k = values.shape
    if k % 32:
        raise ValueError(f"Q4_1 rows take a multiple of 32 values, not {k}")
    x = np.asarray(values, np.float32).reshape(n, k // 32, 32)
    lo, hi = x.min(-1), x.max(-1)
    d, m = ((hi - lo) / 15).astype(np.float16), lo.astype(np.float16)
    d32, m32 = d.astype(np.float32), m.astype(np.float32)
    inv = np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 > 0)
    q = np.clip(np.rint((x - m32[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    out = np.empty((n, k // 32, 20), np.uint8)
    out[..., 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    out[..., 2:4] = m.view(np.uint8).reshape(n, k // 32, 2)
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(n, -1)


def _copy(s: stored.Stored) -> np.ndarray:
    rows = [
        q4_1(stored.values(s.type_name, s.raw[i : i + CHUNK], s.k)) for i in range(0, s.n, CHUNK)
    ]
    return np.concatenate(rows)


def requantize(model: Any) -> tuple[int, int]:
    """Replace `model`'s stored matrices of more than 5 bits a weight with Q4_1 copies (see
    the module's doc); returns (matrices replaced, bytes released)."""
    from mlx.utils import tree_flatten, tree_unflatten

    reg = getattr(model, "adaspec_stored", None)
    if reg is None:
        raise ModelLoadError(
            "4-bit copies are made of a GGUF model's stored weights; this model has none "
            "(accepted: a .gguf file or catalogue name, with ADASPEC_STORED_WEIGHTS on or auto)"
        )
    new: dict[int, stored.Stored] = {}
    before = reg.nbytes
    for s in list(reg.matrices):
        if s.type_name not in KEPT:
            new[id(s.weight)] = reg.add(stored.make("Q4_1", _copy(s), s.k))
    params = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    model.update(tree_unflatten([(k, new[id(a)].weight) for k, a in params if id(a) in new]))
    for _, m in model.named_modules():
        if isinstance(m, stored.StoredEmbedding) and id(m._stored.weight) in new:
            m._stored = new[id(m._stored.weight)]
    reg.drop_unused(model)
    return len(new), before - reg.nbytes
