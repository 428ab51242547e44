"""The block losses as pure mlx functions: cross entropy against the target's greedy labels
(hard) and KL divergence from the target's top-k distribution (soft), position-weighted."""

from __future__ import annotations

import mlx.core as mx


def _weighted_mean(values: mx.array, weight: mx.array) -> mx.array:
    return (values * weight).sum() / mx.maximum(weight.sum(), 1e-9)


def hard_loss(logits: mx.array, lse: mx.array, labels: mx.array, weight: mx.array) -> mx.array:
    """Weighted mean of -log q(label); logits (N, K, V), lse (N, K) their logsumexp,
    labels and weight (N, K)."""
    picked = mx.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return _weighted_mean(lse - picked, weight)


def soft_loss(
    logits: mx.array, lse: mx.array, ids: mx.array, logprobs: mx.array, weight: mx.array
) -> mx.array:
    """Weighted mean of KL(p || q) per position, p the target's top-k distribution renormalised
    over its k ids (N, K, k) and q the drafter's softmax over all V columns. It differs from the
    soft cross entropy -sum p log q by p's entropy only (no gradient) and is 0 at p == q."""
    logq = mx.take_along_axis(logits, ids, axis=-1) - lse[..., None]
    logp = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    kl = (mx.exp(logp) * (logp - logq)).sum(axis=-1)
    return _weighted_mean(kl, weight)


def block_objective(
    logits: mx.array,
    labels: mx.array,
    weight: mx.array,
    soft: float = 0.0,
    ids: mx.array | None = None,
    logprobs: mx.array | None = None,
) -> mx.array:
    """(1 - soft) * hard + soft * KL; the soft term needs the top-k `ids` and `logprobs`."""
    lse = mx.logsumexp(logits, axis=-1)
    loss = hard_loss(logits, lse, labels, weight) if soft < 1 else mx.array(0.0)
    if soft > 0:
        assert ids is not None and logprobs is not None
        loss = (1 - soft) * loss + soft * soft_loss(logits, lse, ids, logprobs, weight)
    return loss
