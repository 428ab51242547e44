"""Tiny random-weight DFlash drafters over the tiny targets, and a plain numpy re-computation of
one drafter forward written from the specification (docs/training.md)."""

from __future__ import annotations

# isort: off
import adaspec  # noqa: F401  (must come first: loads the fast BLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

# isort: on
from adaspec.drafters.base import DraftContext
from adaspec.drafters.dflash import DFlashDrafter
from adaspec.drafters.dflash_model import DFlashConfig, DFlashModel
from adaspec.targets import make_target
from adaspec.targets.base import target_info


def tiny_config(info, *, layers=2, block=8, taps=(0, 1), **over) -> DFlashConfig:
    kw = dict(
        hidden_size=info.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=info.vocab_size,
        target_layer_ids=taps,
        mask_token_id=info.vocab_size - 1,
        block_size=block,
        num_target_layers=info.num_layers,
        rms_norm_eps=1e-5,
    )
    kw.update(over)
    return DFlashConfig(**kw)


def tiny_dflash_model(cfg: DFlashConfig, seed: int = 0, scale: float = 2.0) -> DFlashModel:
    """Random weights; norm gains are perturbed too, so a forgotten norm shows in the output."""
    mx.random.seed(seed)
    model = DFlashModel(cfg)
    model.update(
        tree_map(
            lambda p: p * scale if p.ndim == 2 else 1.0 + 0.2 * mx.random.normal(p.shape),
            model.parameters(),
        )
    )
    mx.eval(model.parameters())
    return model


def tiny_drafter(target, *, seed=0, window=2048, sink=4, **cfg_over) -> DFlashDrafter:
    """A drafter with its own random checkpoint (cfg_over: tiny_config arguments, e.g. block)."""
    info = target_info(target)
    model = tiny_dflash_model(tiny_config(info, **cfg_over), seed)
    return DFlashDrafter(model, info, window=window, sink=sink)


def ctx(
    tokens, features=None, max_draft=64, temperature=0.0, rng=None, tree_nodes=0
) -> DraftContext:
    return DraftContext(
        tokens=list(tokens),
        max_draft=max_draft,
        tree_nodes=tree_nodes,
        features=None if features is None else mx.array(features),
        temperature=temperature,
        rng=rng if rng is not None else np.random.default_rng(0),
    )


def assert_context_matches_fresh_prefill(target, d: DFlashDrafter, committed) -> None:
    """The context a drafter built step by step from verify features equals the one prefilled
    from the target's own tap features of the committed sequence."""
    feats = make_target(target).prefill(committed[:-1], d.needs_taps)
    fresh = DFlashDrafter(d.model, target_info(target), block=d.block, window=d.window, sink=d.sink)
    fresh.prefill(committed, ctx(committed, np.array(feats)))
    np.testing.assert_allclose(
        np.array(d.block_logits(d.block - 1)),
        np.array(fresh.block_logits(d.block - 1)),
        atol=1e-4,
        rtol=1e-4,
    )


# ---- reference forward in float64 numpy, from the specification only ----------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    # x: (n, heads, hd), rotate-half convention (non-traditional), one angle per position
    half = x.shape[-1] // 2
    freqs = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    ang = np.asarray(pos, dtype=np.float64)[:, None, None] * freqs
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate(
        [x1 * np.cos(ang) - x2 * np.sin(ang), x1 * np.sin(ang) + x2 * np.cos(ang)], -1
    )


def reference_logits(cfg, params, embed, head, feats, ctx_pos, last_token, start, block):
    """Logits (block-1, V) of the block [last_token, MASK...] at positions start.., attending
    the context rows `feats` (already selected) at absolute positions ctx_pos."""
    p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    eps, hd = cfg.rms_norm_eps, cfg.head_dim
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    c = _rms(np.asarray(feats, np.float64) @ p["fc.weight"].T, p["hidden_norm.weight"], eps)
    x = embed[[last_token] + [cfg.mask_token_id] * (block - 1)]
    qpos = start + np.arange(block)
    kpos = np.concatenate([np.asarray(ctx_pos), qpos])
    for i in range(cfg.num_hidden_layers):
        w = {k[len(f"layers.{i}.") :]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        h = _rms(x, w["input_layernorm.weight"], eps)
        q = _rope(
            _rms(
                (h @ w["self_attn.q_proj.weight"].T).reshape(block, H, hd),
                w["self_attn.q_norm.weight"],
                eps,
            ),
            qpos,
            cfg.rope_theta,
        )
        both = np.concatenate([c, h])  # context vectors and block share k_proj / v_proj
        k = _rope(
            _rms(
                (both @ w["self_attn.k_proj.weight"].T).reshape(-1, KV, hd),
                w["self_attn.k_norm.weight"],
                eps,
            ),
            kpos,
            cfg.rope_theta,
        )
        v = (both @ w["self_attn.v_proj.weight"].T).reshape(-1, KV, hd)
        visible = np.ones((block, len(kpos)), bool)
        if cfg.causal(i):
            visible &= kpos[None] <= qpos[:, None]
        if cfg.window(i) is not None:
            visible &= np.abs(qpos[:, None] - kpos[None]) < cfg.window(i)
        out = np.zeros((block, H, hd))
        for head_i in range(H):
            g = head_i // (H // KV)
            s = q[:, head_i] @ k[:, g].T / np.sqrt(hd)
            s = np.where(visible, s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            out[:, head_i] = (a / a.sum(-1, keepdims=True)) @ v[:, g]
        x = x + out.reshape(block, H * hd) @ w["self_attn.o_proj.weight"].T
        h = _rms(x, w["post_attention_layernorm.weight"], eps)
        gate = h @ w["mlp.gate_proj.weight"].T
        x = (
            x
            + ((gate / (1 + np.exp(-gate))) * (h @ w["mlp.up_proj.weight"].T))
            @ w["mlp.down_proj.weight"].T
        )
    x = _rms(x, p["norm.weight"], eps)
    return x[1:] @ head.T


def params_of(model: DFlashModel) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}
