"""mlx-lm modules whose work runs in few graph nodes of adaspec's own (kernels/native.py):

- a whole llama / qwen2 decoder layer (the `TransformerBlock` twin, `decode_layer`): both
  norms, every projection, RoPE, the cache write, attention, swiglu and the residual sums in
  one node (`decoder_layer`), where its parts are the layer twins of kernels/layers.py and the
  rows fit the RMSNorm twin (up to layers.RMS_MAX_ROWS);
- attention, where the layer does not fit (qwen3's q/k norms, more rows): q, k and v
  projections in one node (`linears`), then (after the module's q/k norms, where it has them)
  RoPE, the KV cache write and attention in one more (`rope_attention_cache`: ExactRoPE's
  arithmetic, mlx-lm's KVCache layout and mlx's attention), then the module's `o_proj`; the
  cache is left as its `update_and_fetch` leaves it;
- the MLP: gate and up projections in one node (`linears`), then the module's own `swiglu`
  (the function its source calls) and `down_proj`;
- a llama / qwen2 model's layers (`LlamaModel`, `Qwen2Model`): all of them in one node made
  by one Python call (kernels/native_stack.py).

`install` changes the class of each covered instance (llama, qwen2, qwen3 `MLP` and
`Attention`; llama and qwen2 `TransformerBlock` and models) to a subclass made once per class, whose
`__call__` takes the module's own `__call__` wherever the native path does not apply (no
extension, sharded or quantized projections, a cache other than a plain KVCache with room for
the rows, an array mask, a batch of more than one, another dtype or RoPE): that is mlx-lm's
code, on mlx's ops. `uninstall` gives the instances their classes back. No mlx-lm class or
module attribute changes. Tests: tests/test_native.py, tests/test_ops_layers.py (SmolLM2, bit
for bit).
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx

from . import attention, native
from .layers import RMS_MAX_ROWS
from .layers import ExactRoPE as ExactRope
from .native_fit import MODULES, block_parts, plain
from .native_stack import model_call

COVERED = (
    {(m, c) for m in MODULES for c in ("MLP", "Attention")}
    | {(m, "TransformerBlock") for m in MODULES[:2]}
    | {(MODULES[0], "LlamaModel"), (MODULES[1], "Qwen2Model")}
)


def _pair(mlp: Any, x: mx.array) -> list[mx.array] | None:
    """gate and up projections of x in one node, or None where that does not apply"""
    gate, up = mlp.gate_proj, mlp.up_proj
    if x.ndim != 3 or x.shape[0] != 1 or x.dtype != mx.float32:
        return None
    if not (plain(gate) and plain(up)):
        return None
    core = native.get()
    if core is None:
        return None
    return core.linears(x, [gate["weight"], up["weight"]], [gate.get("bias"), up.get("bias")])


def _room(cache: Any, rows: int) -> bool:
    """a plain KVCache whose buffers hold `rows` more (else its update_and_fetch grows them)"""
    from mlx_lm.models.cache import KVCache

    keys = getattr(cache, "keys", None) if type(cache) is KVCache else None
    return (
        keys is not None
        and cache.values is not None
        and keys.dtype == mx.float32
        and cache.offset + rows <= keys.shape[2]
    )


def _solo(attn: Any, x: mx.array, mask: Any, cache: Any) -> tuple[mx.array, mx.array] | None:
    """For one sequence's call (x [1, rows, hidden], no mask or the causal one, a plain
    KVCache with room, `attn` with an ExactRoPE): its rows' angles (cos, sin); else None"""
    if x.ndim != 3 or not (mask is None or (isinstance(mask, str) and mask == "causal")):
        return None
    rows = x.shape[1]
    rope = getattr(attn, "rope", None)
    if type(rope) is not ExactRope or rope.traditional or not _room(cache, rows):
        return None
    return rope._cos_sin(cache.offset, rows)


def _offsets_and_folds(
    attn: Any, caches: list[Any], rows: list[int]
) -> tuple[list[int], list[int]]:
    """The caches' offsets, and how many query heads each sequence's attention GEMMs take"""
    rep, dim = attn.n_heads // attn.n_kv_heads, caches[0].keys.shape[-1]
    offsets = [c.offset for c in caches]
    return offsets, [attention.fold(rep, n, o + n, dim) for o, n in zip(offsets, rows)]


def _advance(caches: list[Any], buffers: list[mx.array], rows: list[int]) -> None:
    """Each cache as its update_and_fetch leaves it: the node's new buffers, rows more"""
    for i, c in enumerate(caches):
        c.keys, c.values = buffers[2 * i], buffers[2 * i + 1]
        c.offset += rows[i]


def _attend(attn: Any, x: mx.array, mask: Any, cache: Any) -> mx.array | None:
    """The attention block in two native nodes and o_proj, or None where that does not apply"""
    angles = _solo(attn, x, mask, cache)
    return None if angles is None else attend_rows(attn, x, [cache], [x.shape[1]], *angles)


def attend_rows(
    attn: Any, x: mx.array, caches: list[Any], rows: list[int], cos: mx.array, sin: mx.array
) -> mx.array | None:
    """`attn` (an mlx-lm Attention with an ExactRoPE) over x's rows [1, M, hidden], the
    rows[i] rows of sequence i (in order) against caches[i], each at its own positions (cos
    and sin [M, dims / 2]: every row's angles), in two native nodes: q/k/v, then RoPE, the
    cache writes and attention; o_proj's output for all rows, the caches left as their
    update_and_fetch leaves them. None where that does not apply (nothing is changed then)."""
    rope = getattr(attn, "rope", None)
    if (
        x.ndim != 3
        or x.shape[0] != 1
        or x.dtype != mx.float32
        or type(rope) is not ExactRope
        or rope.traditional
        or not all(plain(attn[p]) for p in ("q_proj", "k_proj", "v_proj"))
        or not all(_room(c, n) for c, n in zip(caches, rows))
    ):
        return None
    core = native.get()
    if core is None:
        return None
    projs = [attn[p] for p in ("q_proj", "k_proj", "v_proj")]
    q, k, v = core.linears(x, [p["weight"] for p in projs], [p.get("bias") for p in projs])
    m = x.shape[1]
    if "q_norm" in attn:  # qwen3: per-head norms before RoPE, as its source applies them
        q = attn.q_norm(q.reshape(1, m, attn.n_heads, -1))
        k = attn.k_norm(k.reshape(1, m, attn.n_kv_heads, -1))
    offsets, fold = _offsets_and_folds(attn, caches, rows)
    out, *buffers = core.rope_attention_cache(
        q, k, v, cos, sin, rope.dims, attn.n_heads, attn.n_kv_heads,
        [c.keys for c in caches], [c.values for c in caches], rows, offsets, fold, attn.scale,
    )  # fmt: skip
    _advance(caches, buffers, rows)
    return attn.o_proj(out)


def decode_layer(block: Any, x: mx.array, mask: Any, cache: Any) -> mx.array | None:
    """A llama / qwen2 decoder layer (`block`, an mlx-lm TransformerBlock) over x's rows in one
    native node (`decoder_layer`: the norms, projections, RoPE, cache write, attention, swiglu
    and residual sums, each with the bits of the graph it stands for); the cache is left as its
    update_and_fetch leaves it. None where that does not apply (nothing is changed then)."""
    angles = _solo(block.get("self_attn"), x, mask, cache)
    return None if angles is None else layer_rows(block, x, [cache], [x.shape[1]], *angles)


def layer_rows(
    block: Any, x: mx.array, caches: list[Any], rows: list[int], cos: mx.array, sin: mx.array
) -> mx.array | None:
    """`block` over x's rows [1, M, hidden], the rows[i] rows of sequence i (in order) against
    caches[i], each at its own positions (cos and sin [M, dims / 2]: every row's angles), in one
    native node; the caches left as their update_and_fetch leaves them. None where that does
    not apply (nothing is changed then)."""
    if (
        x.ndim != 3
        or x.shape[0] != 1
        or x.dtype != mx.float32
        or not 0 < x.shape[1] <= RMS_MAX_ROWS
        or not all(_room(c, n) for c, n in zip(caches, rows))
    ):
        return None
    projs, core = block_parts(block), native.get()
    if projs is None or core is None:
        return None
    attn = block.self_attn
    offsets, fold = _offsets_and_folds(attn, caches, rows)
    n1, n2 = block.input_layernorm, block.post_attention_layernorm
    out, *buffers = core.decoder_layer(
        x, n1.weight, n2.weight, n1.eps, n2.eps, [p["weight"] for p in projs],
        [p.get("bias") for p in projs], cos, sin, attn.rope.dims, attn.n_heads,
        attn.n_kv_heads, [c.keys for c in caches], [c.values for c in caches], rows, offsets,
        fold, attn.scale,
    )  # fmt: skip
    _advance(caches, buffers, rows)
    return out


_twins: dict[type, type] = {}


def _mlp_call(cls: type) -> Any:
    swiglu = sys.modules[cls.__module__].swiglu

    def __call__(self, x: mx.array) -> mx.array:  # noqa: N807
        pair = _pair(self, x)
        if pair is None:
            return cls.__call__(self, x)
        return self.down_proj(swiglu(*pair))

    return __call__


def _attention_call(cls: type) -> Any:
    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:  # noqa: N807
        out = _attend(self, x, mask, cache)
        return cls.__call__(self, x, mask, cache) if out is None else out

    return __call__


def _block_call(cls: type) -> Any:
    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:  # noqa: N807
        out = decode_layer(self, x, mask, cache)
        return cls.__call__(self, x, mask, cache) if out is None else out

    return __call__


_CALLS = {
    "MLP": _mlp_call, "Attention": _attention_call, "TransformerBlock": _block_call,
    "LlamaModel": model_call, "Qwen2Model": model_call,
}  # fmt: skip


def _twin_class(cls: type) -> type:
    hit = _twins.get(cls)
    if hit is None:
        call = _CALLS[cls.__name__](cls)
        hit = _twins[cls] = type(cls.__name__, (cls,), {"__call__": call, "_native": cls})
    return hit


def install(model: Any) -> int:
    """Give each covered instance of `model` its twin class (native extension permitting);
    returns how many were changed."""
    if native.get() is None:
        return 0
    changed = 0
    for _, m in model.named_modules():
        cls = type(m)
        if (cls.__module__, cls.__name__) in COVERED and "_native" not in cls.__dict__:
            m.__class__ = _twin_class(cls)
            changed += 1
    return changed


def uninstall(model: Any) -> int:
    """Give the instances `install` changed their mlx-lm class back; returns how many."""
    changed = 0
    for _, m in model.named_modules():
        base = type(m).__dict__.get("_native")
        if base is not None:
            m.__class__ = base
            changed += 1
    return changed
