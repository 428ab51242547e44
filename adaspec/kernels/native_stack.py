"""A llama / qwen2 model's decoder layers in one graph node, made in one Python call (the
native `DecoderStack`, whose `DecoderLayers` node runs each layer's `DecoderLayer` work on the
output of the one before, so the same bits) instead of a node per layer made by a call per
layer (native_layers.decode_layer): that costs ~17 us of Python per layer (its checks, its
weight lists, the node's arguments) plus mlx's scheduling of each node, on SmolLM2-135M's 30
layers most of a millisecond of a 5 ms step.

`install` (native_layers) gives llama's `LlamaModel` and qwen2's `Qwen2Model` a twin whose
`__call__` runs the stack where the model's own code would run exactly those layers: one
sequence of up to layers.RMS_MAX_ROWS fp32 rows, every layer a native TransformerBlock twin
that `layer_fits`, every cache a plain KVCache at one offset with room for the rows, the mask
the model would make None or "causal" (no sliding window, one pipeline rank). Anywhere else the
model's own `__call__` runs (and with it each layer's, as before).

What a stack holds (each layer's norm weights, projections' weights and biases, the shared
head counts, RoPE and scale) is read once per model into a `Plan`, kept on the model and reused
while every module and array it read is still the one the model holds (checked by identity on
each call, ~30 us on SmolLM2); when one was replaced (new weights, another module, a spy in
the layer list) the plan is read again, or the model's own code runs. Layers that do not fit
(quantized projections, other head counts) are refused once per layer list: a refusal is
kept while the list holds the same layers, and each layer's own call then decides per call.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from itertools import repeat
from operator import is_
from typing import Any

import mlx.core as mx

from . import attention, native
from .layers import RMS_MAX_ROWS
from .native_fit import PROJECTIONS, layer_fits

_PLAN = "_adaspec_stack"  # the model attribute a plan is kept in (not module state)


@dataclass(frozen=True)
class Plan:
    """What a model's stack was made of: `layers` (by identity) and every (container, key,
    value) it read; `stack` None where the layers do not fit (then the model's code runs)."""

    layers: tuple[Any, ...]
    containers: tuple[Any, ...]
    keys: tuple[str, ...]
    values: tuple[Any, ...]
    stack: Any
    rope: Any = None
    rep: int = 0

    def holds(self, layers: list[Any]) -> bool:
        """whether the model still holds what the plan was made of"""
        return (
            len(layers) == len(self.layers)
            and all(map(is_, layers, self.layers))
            and all(map(is_, map(dict.get, self.containers, self.keys), self.values))
        )


def _block_twin(block: Any) -> bool:
    """a llama / qwen2 TransformerBlock whose class is native_layers' twin (its __call__ is the
    native layer or mlx-lm's own code, which the stack stands for)"""
    base = type(block).__dict__.get("_native")
    return base is not None and base.__name__ == "TransformerBlock"


def _read(layers: list[Any]) -> Plan:
    core = native.get()
    watched: list[tuple[Any, str, Any]] = []

    def read(container: Any, key: str) -> Any:
        value = dict.get(container, key)
        watched.append((container, key, value))
        return value

    refused = Plan(tuple(layers), (), (), (), None)
    if core is None or not layers or not all(map(_block_twin, layers)):
        return refused
    norms: tuple[list, list] = ([], [])
    eps: tuple[list, list] = ([], [])
    weights, biases, shared = [], [], set()
    for block in layers:
        if not layer_fits(block):
            return refused
        for j, key in enumerate(("input_layernorm", "post_attention_layernorm")):
            norm = read(block, key)
            norms[j].append(read(norm, "weight"))
            eps[j].append(norm.eps)
        parts = {key: read(block, key) for key in ("self_attn", "mlp")}
        projs = [read(parts[key], p) for key, p in PROJECTIONS]
        weights.append([read(p, "weight") for p in projs])
        biases.append([read(p, "bias") for p in projs])
        attn = parts["self_attn"]
        rope = read(attn, "rope")
        shared.add((attn.n_heads, attn.n_kv_heads, attn.scale, rope._key))
    if len(shared) != 1:  # layers of other head counts, scale or RoPE: one call per layer
        return refused
    heads, kv_heads, scale, (dims, *_) = shared.pop()
    stack = core.DecoderStack(*norms, *eps, weights, biases, dims, heads, kv_heads, scale)
    containers, keys, values = zip(*watched)
    return Plan(tuple(layers), containers, keys, values, stack, rope, heads // kv_heads)


def plan(model: Any) -> Plan:
    """`model`'s plan (an inner LlamaModel / Qwen2Model), read again where it no longer holds"""
    layers = model.layers
    kept = model.__dict__.get(_PLAN)
    if kept is not None and kept.holds(layers):
        return kept
    fresh = _read(layers)
    object.__setattr__(model, _PLAN, fresh)
    return fresh


def stacks(model: Any, rows: int) -> bool:
    """Whether a forward of `rows` rows through the inner `model` may run as one stack (its
    layers fit; the caches are checked at the call). A kept plan is taken as it is (the call
    checks it again: where it no longer holds, the forward runs layer by layer, at no cost to
    its results), so a forward is checked once, not twice."""
    if "_native" not in type(model).__dict__ or not 0 < rows <= RMS_MAX_ROWS:
        return False
    kept = model.__dict__.get(_PLAN)
    return (kept if kept is not None else plan(model)).stack is not None


def _caches_fit(caches: list[Any], n: int, rows: int) -> bool:
    from mlx_lm.models.cache import KVCache

    if len(caches) != n or not all(map(is_, map(type, caches), repeat(KVCache))):
        return False
    offset = caches[0].offset
    for c in caches:
        keys = c.keys
        if (
            keys is None
            or c.offset != offset
            or keys.dtype != mx.float32
            or offset + rows > keys.shape[2]
        ):
            return False
    return True


def run(model: Any, source: Any, inputs: mx.array, cache: Any, embeddings: Any) -> mx.array | None:
    """The inner model's forward as one stack (`source`: the mlx-lm module of its class), or
    None where its own code must run"""
    if cache is None or getattr(model, "swa_idx", None) is not None:
        return None
    if getattr(model, "pipeline_size", 1) != 1:
        return None
    src = inputs if embeddings is None else embeddings
    if src.ndim != (2 if embeddings is None else 3) or src.shape[0] != 1:
        return None
    rows = src.shape[1]
    if not 0 < rows <= RMS_MAX_ROWS:
        return None
    p = plan(model)
    if p.stack is None or not _caches_fit(cache, len(p.layers), rows):
        return None
    mask = source.create_attention_mask(src, cache[0])
    if not (mask is None or (isinstance(mask, str) and mask == "causal")):
        return None
    h = model.embed_tokens(inputs) if embeddings is None else embeddings
    if h.dtype != mx.float32:
        return None
    offset = cache[0].offset
    cos, sin = p.rope._cos_sin(offset, rows)
    fold = attention.fold(p.rep, rows, offset + rows, cache[0].keys.shape[-1])
    keys, values = [c.keys for c in cache], [c.values for c in cache]
    out = p.stack(h, keys, values, rows, offset, fold, cos, sin)
    for i, c in enumerate(cache):
        c.keys, c.values = out[2 * i + 1], out[2 * i + 2]
        c.offset += rows
    return model.norm(out[0])


def model_call(cls: type) -> Any:
    """the `__call__` of `cls`' twin (an mlx-lm LlamaModel or Qwen2Model)"""
    source = sys.modules[cls.__module__]

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: Any = None) -> Any:  # noqa: N807
        out = run(self, source, inputs, cache, input_embeddings)
        return cls.__call__(self, inputs, cache, input_embeddings) if out is None else out

    return __call__
