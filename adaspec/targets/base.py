"""What a target is: the Target protocol, its Forward result and TargetInfo, model
introspection, layer taps, and the cached forward both adapters (kv, replay) build on."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from ..errors import TargetError
from ..kernels import native_stack


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter factory may know about the target it will draft for."""

    model: Any  # the mlx-lm nn.Module (for embedding / lm_head binding, e.g. DFlash)
    tokenizer: Any  # mlx-lm TokenizerWrapper or None
    vocab_size: int
    hidden_size: int
    num_layers: int
    model_type: str = ""


@dataclass(frozen=True)
class Forward:
    """Result of feeding n tokens to the target.

    logits: (n, V) float32; row i predicts the token after tokens[i].
    features: (n, len(taps) * hidden) concatenated tap hidden states, or None without taps.
    """

    logits: mx.array
    features: mx.array | None


class Target(Protocol):
    """What the controller needs from a target; `rollback_kind` says how rollback works."""

    rollback_kind: str  # "trim" (KV caches) | "replay" (recurrent state)
    tree_unsupported: str  # "" when forward_tree works, else why the target verifies chains only
    info: TargetInfo

    @property
    def offset(self) -> int: ...

    def prefill(self, tokens: Sequence[int], taps: tuple[int, ...] = ()) -> mx.array | None: ...

    def forward(self, tokens: Sequence[int] | mx.array, taps: tuple[int, ...] = ()) -> Forward: ...

    def rollback(self, n: int) -> None: ...

    def forward_tree(
        self, tokens: Sequence[int], parents: Sequence[int], taps: tuple[int, ...] = ()
    ) -> Forward:
        """Feed [last committed token, nodes...] as a tree (parents per node, -1: the first
        token); row 0 of the result is the first token, row i+1 node i."""
        ...

    def keep_path(self, path: Sequence[int]) -> None:
        """After forward_tree: keep the first token and the nodes of `path` (root down), drop
        the rest."""
        ...


def inner_model(model: Any) -> Any:
    """The module that owns the decoder layer list (model.model for mlx-lm LMs)."""
    for path in ("model", "language_model.model", "backbone"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None and isinstance(getattr(obj, "layers", None), list):
            return obj
    raise TargetError(
        f"cannot find the decoder layer list of {type(model).__name__}; accepted: mlx-lm "
        "models with model.layers (or language_model.model.layers)"
    )


def embedding_and_head(model: Any) -> tuple[Any, Any]:
    """The target's token embedding and its output projection (tied: the embedding's
    as_linear), which DFlash drafters borrow; mlx-lm names the embedding embed_tokens, or
    embeddings on the Mamba family."""
    inner = inner_model(model)
    embed = getattr(inner, "embed_tokens", None) or getattr(inner, "embeddings", None)
    if embed is None:
        raise TargetError(
            f"cannot find the token embedding of {type(model).__name__}; accepted: mlx-lm models "
            "whose decoder has embed_tokens or embeddings"
        )
    head = getattr(model, "lm_head", None)
    return embed, head if head is not None else embed.as_linear


def layer_list(model: Any) -> list:
    return inner_model(model).layers


def model_type(model: Any) -> str:
    """The top-level mlx-lm model type (e.g. "qwen3_5", not its text config's)."""
    args = getattr(model, "args", None)
    return str(getattr(model, "model_type", None) or getattr(args, "model_type", ""))


def target_info(model: Any, tokenizer: Any = None) -> TargetInfo:
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    src = text if isinstance(text, dict) else vars(args) if args is not None else {}
    vocab = src.get("vocab_size") or getattr(args, "vocab_size", None)
    hidden = src.get("hidden_size") or getattr(args, "hidden_size", None)
    if vocab is None or hidden is None:
        raise TargetError(f"{type(model).__name__} has no vocab_size/hidden_size in its args")
    return TargetInfo(
        model=model,
        tokenizer=tokenizer,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        num_layers=len(layer_list(model)),
        model_type=str(src.get("model_type") or getattr(args, "model_type", "")),
    )


class Spy:
    """Stands in for a module and records each call's positional arguments and output."""

    def __init__(self, module: Any):
        self.module = module
        self.calls: list[tuple[tuple, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        self.calls.append((args, out))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


class Handoff(Spy):
    """Stands in for a decoder layer and hands its output to mlx's stream as soon as it is
    built (async_eval): the layers up to it compute while the rest of the graph is built."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        mx.async_eval(out)
        return out


def handoff_layers(num_layers: int, pieces: int) -> list[int]:
    """The layers whose outputs are handed to the stream so that a forward of `num_layers`
    layers runs in `pieces` nearly equal pieces (the last one ends with the logits)."""
    pieces = max(1, min(pieces, num_layers))
    return [num_layers * j // pieces - 1 for j in range(1, pieces)]


@contextmanager
def spying(slots: Sequence[tuple[Any, Any]], wrap: type[Spy] = Spy) -> Iterator[list[Spy]]:
    """Inside the block, `container[key]` is a `wrap` (a Spy) for each (container, key) in
    `slots` (a layer list and an index, or an nn.Module and a child's name); restored in
    `finally`."""
    originals = [(c, k, c[k]) for c, k in slots]
    spies = [wrap(o) for _, _, o in originals]
    try:
        for (c, k, _), spy in zip(originals, spies):
            c[k] = spy
        yield spies
    finally:
        for c, k, o in reversed(originals):
            c[k] = o


def layer_output(spy: Spy) -> mx.array:
    """The hidden state a spied decoder layer returned on its last call (batch row 0)."""
    out = spy.calls[-1][1]
    return (out[0] if isinstance(out, tuple) else out)[0]


def _check_taps(info: TargetInfo, taps: tuple[int, ...]) -> None:
    bad = [i for i in taps if not 0 <= i < info.num_layers]
    if bad:
        raise TargetError(
            f"tap layer ids {bad} are out of range; accepted: 0..{info.num_layers - 1}"
        )


class CacheTarget:
    """What both adapters share: the mlx-lm cache, the tapped forward and chunked prefill.
    pieces: a forward's graph is handed to mlx's stream in this many pieces as it is built
    (Handoff), so a forward read at once does not wait for its whole graph to be built first;
    1 = in one piece, when it is read (make_target sets ADASPEC_FORWARD_PIECES); one piece where
    the model's layers run in one node (kernels/native_stack.py), built in ~0.4 ms."""

    tree_unsupported = "recurrent state"
    pieces = 10

    def __init__(self, model: Any, tokenizer: Any = None, *, prefill_step: int = 2048):
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.info = target_info(model, tokenizer)
        self.cache = make_prompt_cache(model)
        self.prefill_step = prefill_step
        self._offset = 0

    @property
    def offset(self) -> int:
        return self._offset

    def run(self, tokens: Sequence[int] | mx.array, taps: tuple[int, ...]) -> tuple[mx.array, list]:
        """One forward through the cache, the offset untouched: (logits, tap hidden states).
        An mx.array may still be lazy: the caller can queue this forward before reading it."""
        x = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.uint32)
        x = x.astype(mx.uint32)[None]
        inner = inner_model(self.model)
        layers = inner.layers
        one_call = not taps and native_stack.stacks(inner, x.shape[1])  # nothing to hand off
        pieces = 1 if one_call else self.pieces
        handoffs = [(layers, i) for i in handoff_layers(len(layers), pieces)]
        with spying([(layers, i) for i in taps]) as spies, spying(handoffs, Handoff):
            logits = self.model(x, cache=self.cache)[0]
        return logits, [layer_output(s) for s in spies]

    def prefill(self, tokens: Sequence[int], taps: tuple[int, ...] = ()) -> mx.array | None:
        """Feed `tokens` in chunks; returns their tap features (or None without taps)."""
        _check_taps(self.info, taps)
        feats = []
        for start in range(0, len(tokens), self.prefill_step):
            chunk = tokens[start : start + self.prefill_step]
            _, hs = self.run(chunk, taps)
            if taps:
                feats.append(mx.concatenate(hs, axis=-1))
                mx.eval(feats[-1])
            mx.eval([c.state for c in self.cache])
            self._offset += len(chunk)
        if not taps:
            return None
        if not feats:
            return mx.zeros((0, len(taps) * self.info.hidden_size))
        return mx.concatenate(feats, axis=0)

    def forward(self, tokens: Sequence[int] | mx.array, taps: tuple[int, ...] = ()) -> Forward:
        logits, hs = self.run(tokens, taps)
        self._offset += len(tokens)
        feats = mx.concatenate(hs, axis=-1) if taps else None
        return Forward(logits.astype(mx.float32), feats)

    def forward_tree(
        self, tokens: Sequence[int], parents: Sequence[int], taps: tuple[int, ...] = ()
    ) -> Forward:
        raise TargetError(f"this target verifies chains only: {self.tree_unsupported}")

    def keep_path(self, path: Sequence[int]) -> None:
        raise TargetError(f"this target verifies chains only: {self.tree_unsupported}")
