"""Load a GGUF model with its quantized weights at their stored bits (kernels/stored.py).

The cache entry holds the config, the tokenizer and the few tensors that stay fp32 (norms,
biases); the matrices listed in its stored.json are read from the GGUF file into mlx memory
as stored and put in the model as views the routed kernel reads. No fp32 copy of them is ever
made, so a model takes about its file's size in memory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

from ..errors import ModelLoadError
from ..settings import Settings

log = logging.getLogger(__name__)


def enabled(settings: Settings) -> bool:
    """Whether GGUF models load at their stored bits (`ADASPEC_STORED_WEIGHTS`)."""
    from ..kernels import stored

    if settings.stored_weights == "auto":
        return stored.router() is not None
    return settings.stored_weights == "on"


def load(entry: Path, src: Path) -> tuple[Any, Any]:
    """(model, TokenizerWrapper) from a stored cache entry and its GGUF file."""
    from mlx_lm.utils import load_model, load_tokenizer

    from ..kernels import stored
    from . import gguf

    registry = stored.Registry()  # fails first when no routed kernel can read the bytes
    try:
        model, config = load_model(entry, lazy=True, strict=False)
    except Exception as exc:
        raise ModelLoadError(f"mlx_lm could not build the model in {str(entry)!r}: {exc}") from exc
    index = json.loads((entry / gguf.STORED_INDEX).read_text())["tensors"]
    tensors = {t.name: t for t in gguf.open_reader(src).tensors}
    weights = []
    for item in index:
        t = tensors.get(item["tensor"])
        if t is None or t.tensor_type.name != item["type"]:
            raise ModelLoadError(f"{src} does not hold {item['tensor']} as {item['type']}")
        raw = gguf.stored_rows(t, item["name"], config)
        s = registry.add(stored.make(item["type"], raw, item["shape"][1]))
        weights.append((item["name"], s))
    _install(model, weights)
    model.adaspec_stored = registry  # registered while the model lives
    import mlx.core as mx

    mx.eval(model.parameters())
    tokenizer = load_tokenizer(entry, None, eos_token_ids=config.get("eos_token_id", None))
    log.info("loaded %s: %d matrices as stored, %.1f MB", src, len(weights), registry.nbytes / 1e6)
    return model, tokenizer


def _install(model: Any, weights: list[tuple[str, Any]]) -> None:
    """Put each stored matrix's view where its fp32 weight would go; an embedding table
    becomes a StoredEmbedding (a lookup must gather from the bytes, not from the view)."""
    import mlx.nn as nn

    from ..kernels.stored import StoredEmbedding

    plain = []
    for name, s in weights:
        path, _, leaf = name.rpartition(".")
        owner = _module(model, path)
        if leaf == "weight" and isinstance(owner, nn.Embedding):
            parent, _, attr = path.rpartition(".")
            setattr(_module(model, parent), attr, StoredEmbedding(s))
        else:
            plain.append((name, s.weight))
    model.load_weights(plain, strict=False)


def _module(model: Any, path: str) -> Any:
    node = model
    for part in path.split(".") if path else ():
        node = node[int(part)] if isinstance(node, list) else getattr(node, part)
    return node


def from_halves(model: Any) -> int:
    """An mlx-lm model whose weights are bf16 or fp16 (most Hugging Face checkpoints) onto
    fp32 compute without an fp32 copy: each such linear or embedding matrix is read at its
    2-byte stored bits (exactly its fp32 expansion), every other float parameter becomes
    fp32. Returns how many matrices stay stored."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx.utils import tree_flatten

    from ..kernels import stored

    kinds = {mx.bfloat16: "BF16", mx.float16: "F16"}
    owners = {n: m for n, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)}
    chosen = []
    # mlx types tree_flatten's result as a list or a dict; it is the list without destination
    for name, p in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())):
        path, _, leaf = name.rpartition(".")
        if leaf == "weight" and path in owners and p.dtype in kinds and p.ndim == 2:
            if stored.readable(kinds[p.dtype], tuple(p.shape)):
                chosen.append((name, kinds[p.dtype], p))
    if not chosen:
        return 0
    registry = stored.Registry()
    weights = []
    for name, kind, p in chosen:
        raw = np.array(p.view(mx.uint16)).view(np.uint8).reshape(p.shape[0], -1)
        weights.append((name, registry.add(stored.make(kind, raw, p.shape[1]))))
    _install(model, weights)
    model.adaspec_stored = registry
    model.set_dtype(mx.float32)  # the rest (norms, biases); the stored views are fp32 already
    mx.eval(model.parameters())
    return len(weights)
