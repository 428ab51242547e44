"""The DFlash drafter network: Qwen3-style layers whose attention also sees the target's context,
and its config as z-lab's config.json spells it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import DrafterError, ModelLoadError
from ..kernels.attention import sdpa

LAYER_TYPES = ("full_attention", "sliding_attention")
ARCHITECTURE = "DFlashDraftModel"
_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
)
_KNOWN = {
    *_REQUIRED,
    *"head_dim max_position_embeddings num_target_layers layer_types sliding_window".split(),
    *"is_causal rope_theta rope_scaling rope_parameters dflash_config architectures".split(),
    *"model_type torch_dtype dtype".split(),
}


@dataclass
class DFlashConfig:
    """The fields of z-lab's config.json this implementation uses."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    num_target_layers: int | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # None follows z-lab's reference: sliding layers causal inside the block, full ones not.
    is_causal: bool | None = None
    extra: dict = field(default_factory=dict)  # other config.json keys, written back by save

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // max(self.num_attention_heads, 1)
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        self.layer_types = tuple(self.layer_types) or ("full_attention",) * self.num_hidden_layers
        self._check()

    def _check(self) -> None:
        def bad(what: str, accepted: str) -> DrafterError:
            return DrafterError(f"DFlash config {what} is invalid; accepted: {accepted}")

        for k in (*_REQUIRED[:-1], "head_dim"):
            if getattr(self, k) <= 0:
                raise bad(f"{k}={getattr(self, k)}", "a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                f"num_attention_heads={self.num_attention_heads} with num_key_value_heads="
                f"{self.num_key_value_heads}",
                "a number of attention heads divisible by the number of key/value heads",
            )
        if not self.target_layer_ids:
            raise bad("dflash_config.target_layer_ids=[]", "at least one target layer id")
        if self.block_size < 2:
            raise bad(f"dflash_config.block_size={self.block_size}", "an integer >= 2")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise bad(
                f"dflash_config.mask_token_id={self.mask_token_id}", f"0..{self.vocab_size - 1}"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad(
                f"layer_types of length {len(self.layer_types)}",
                f"one entry per layer (num_hidden_layers={self.num_hidden_layers})",
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise bad(f"layer_types {unknown}", ", ".join(LAYER_TYPES))
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise bad(
                f"sliding_window={self.sliding_window}",
                "a positive sliding_window when layer_types has sliding_attention",
            )

    def causal(self, layer: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        dflash = d.get("dflash_config")
        dflash = dflash if isinstance(dflash, dict) else {}
        missing = [k for k in _REQUIRED if k not in d] + [
            f"dflash_config.{k}" for k in ("target_layer_ids", "mask_token_id") if k not in dflash
        ]
        if missing:
            raise ModelLoadError(f"DFlash config.json lacks {', '.join(missing)}")
        arch = (d.get("architectures") or [ARCHITECTURE])[0]
        if arch != ARCHITECTURE:
            raise DrafterError(
                f"DFlash architecture {arch!r} is not supported; accepted: {ARCHITECTURE}"
            )
        rope = d.get("rope_parameters") or {}
        default_rope = rope.get("rope_type", "default") == "default"
        try:
            return cls(
                **{k: int(d[k]) for k in _REQUIRED if k != "rms_norm_eps"},
                rms_norm_eps=float(d["rms_norm_eps"]),
                target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
                mask_token_id=int(dflash["mask_token_id"]),
                block_size=int(dflash.get("block_size", 16)),
                head_dim=int(d.get("head_dim") or 0),
                rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=d.get("rope_scaling") or (None if default_rope else rope),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                num_target_layers=d.get("num_target_layers"),
                layer_types=tuple(d.get("layer_types") or ()),
                sliding_window=d.get("sliding_window"),
                is_causal=d.get("is_causal", dflash.get("causal")),
                extra={k: v for k, v in d.items() if k not in _KNOWN},
            )
        except DrafterError:
            raise
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(
                f"DFlash config.json has a value of the wrong type: {exc}"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        d = {**self.extra, "architectures": [ARCHITECTURE], "model_type": "qwen3"}
        d.update({k: getattr(self, k) for k in _REQUIRED})
        d.update(
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            num_target_layers=self.num_target_layers,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window,
            attention_bias=False,
            hidden_act="silu",
            tie_word_embeddings=False,
            dflash_config={
                "block_size": self.block_size,
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
        )
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        return d


class Attention(nn.Module):
    """Queries from the block; keys/values from context and block through the same k/v_proj."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)

    def kv(self, x: mx.array, start: Any, rope: Any) -> tuple[mx.array, mx.array]:
        """x: (N, m, d), row r at absolute positions start[r].. (start: int or (N,) array)
        -> keys, values (N, n_kv, m, head_dim)."""
        N, m = x.shape[:2]
        k = self.k_norm(self.k_proj(x).reshape(N, m, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(N, m, self.n_kv, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=start), v

    def __call__(self, x, ctx_k, ctx_v, start, rope, mask):
        """x (N, B, d): N blocks, N/S consecutive ones per context sequence of ctx_k/ctx_v
        (S, n_kv, T, hd); the blocks of a sequence attend as one row of queries (no copies of
        the context per block), `mask` (S, 1, N/S * B, T + N/S * B) keeping them apart."""
        N, B = x.shape[:2]
        S = ctx_k.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(N, B, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=start)
        k, v = self.kv(x, start, rope)

        def group(t: mx.array) -> mx.array:  # (N, h, B, hd) -> (S, h, N/S * B, hd)
            h = t.shape[1]
            return (
                t.reshape(S, N // S, h, B, -1)
                .transpose(0, 2, 1, 3, 4)
                .reshape(S, h, -1, t.shape[-1])
            )

        keys = mx.concatenate([ctx_k, group(k)], axis=2)
        values = mx.concatenate([ctx_v, group(v)], axis=2)
        o = sdpa(group(q), keys, values, scale=self.head_dim**-0.5, mask=mask)
        o = o.reshape(S, self.n_heads, N // S, B, -1).transpose(0, 2, 3, 1, 4)
        return self.o_proj(o.reshape(N, B, -1))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, ctx_k, ctx_v, start, rope, mask):
        h = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, start, rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """Drafter weights only; the target's embedding and head are applied by the caller."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        from mlx_lm.models.rope_utils import initialize_rope

        self.cfg = cfg
        # token set of a restricted draft head (most frequent first), stored with the
        # checkpoint; a numpy array, so not a trained parameter; None: the full vocabulary
        self.head_token_ids: np.ndarray | None = None
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.layers = [Layer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self._rope = initialize_rope(
            cfg.head_dim, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )

    def context_kv(self, features: mx.array, start: int) -> list[tuple[mx.array, mx.array]]:
        """features ([N,] m, n_taps*d) of positions start..start+m-1 -> per layer (keys, values)
        of shape (N or 1, n_kv, m, head_dim)."""
        f = features.astype(mx.float32)
        c = self.hidden_norm(self.fc(f if f.ndim == 3 else f[None]))
        return [layer.self_attn.kv(c, start, self._rope) for layer in self.layers]

    def blocks(self, x: mx.array, ctx: list[tuple[mx.array, mx.array]], starts: Any, mask: Any):
        """Training form: x (N, B, d) blocks at positions starts (N,), N/S consecutive blocks per
        sequence, attending its context rows ctx[layer] = (keys, values) of shape
        (S, n_kv, T, hd) under `mask` (S, 1, N/S * B, T + N/S * B) (objective.group_mask)."""
        for layer, (k, v) in zip(self.layers, ctx):
            x = layer(x, k, v, starts, self._rope, mask)
        return self.norm(x)

    def __call__(
        self,
        x: mx.array,
        ctx: list[tuple[mx.array, mx.array]],
        start: int,
        ctx_pos: np.ndarray,
    ) -> mx.array:
        """x (1, B, d): embedded block at positions start..; ctx: per layer attended context
        keys/values at absolute positions ctx_pos. Returns the final-normed hidden (1, B, d)."""
        for i, (layer, (k, v)) in enumerate(zip(self.layers, ctx)):
            x = layer(x, k, v, start, self._rope, self._mask(i, ctx_pos, start, x.shape[1]))
        return self.norm(x)

    def _mask(self, i: int, ctx_pos: np.ndarray, start: int, B: int) -> mx.array | None:
        causal, window = self.cfg.causal(i), self.cfg.window(i)
        if not causal and window is None:
            return None  # bidirectional block that sees every attended context row
        q = start + np.arange(B)[:, None]
        k = np.concatenate([ctx_pos, start + np.arange(B)])[None]
        ok = np.ones((B, k.shape[1]), dtype=bool)
        if causal:
            ok &= k <= q
        if window is not None:
            ok &= np.abs(q - k) < window
        return mx.array(ok)
