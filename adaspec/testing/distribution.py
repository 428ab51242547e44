"""Exact target distributions and a chi-square check of sampled counts against them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from scipy.stats import chisquare

from adaspec.loop import sampling


def target_dist(model, tokens, params) -> np.ndarray:
    """The distribution the target samples its next token from after `tokens` (float64)."""
    logits = model(mx.array(list(tokens))[None])[0, -1:].astype(mx.float32)
    return np.array(sampling.probs(sampling.logprobs(logits), params))[0].astype(np.float64)


def exact_sequences(model, prompt, v, length, params) -> np.ndarray:
    """Exact joint distribution of the next `length` tokens, flattened in row-major order."""

    def rec(prefix, depth):
        p = target_dist(model, list(prompt) + prefix, params)
        if depth == 1:
            return p
        return np.concatenate([p[a] * rec(prefix + [a], depth - 1) for a in range(v)])

    return rec([], length)


def chi_square_pvalue(counts, probs) -> float:
    """Chi-square p-value of observed `counts` against `probs` (cells expected < 5 pooled)."""
    exp = probs * counts.sum()
    keep = exp >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    e = np.append(exp[keep], exp[~keep].sum())
    obs, e = (obs, e) if e[-1] > 0 else (obs[:-1], e[:-1])
    return float(chisquare(obs, e * obs.sum() / e.sum()).pvalue)


def assert_same(counts, probs, min_pvalue: float = 1e-3) -> None:
    """Chi-square: observed counts follow `probs`."""
    pvalue = chi_square_pvalue(counts, probs)
    assert pvalue > min_pvalue, f"chi-square p-value {pvalue:.2e} <= {min_pvalue}"


def speculative_counts(target, drafter, prompt, v, params, length=3, runs=1200):
    """Counts of every `length`-token continuation over `runs` seeded speculative decodes on a
    KV target (index (t0 * v + t1) * v + t2 ...), and how many tokens the last run drafted."""
    from adaspec.loop.controller import DecodeConfig, Decoder, decode
    from adaspec.targets.kv import KVTarget

    counts = np.zeros(v**length)
    for s in range(runs):
        dec = Decoder(
            KVTarget(target),
            drafter,
            DecodeConfig(max_tokens=length, sampling=params),
            rng=np.random.default_rng(s),
        )
        index = 0
        for e in decode(dec, prompt):
            index = index * v + e.token
        counts[index] += 1
    return counts, dec.stats.drafted
