"""The target's next-token distributions as mlx-lm's AR path builds them (log-softmax, sampler
filters, temperature): what the policy verifies against and what a
sampling drafter proposes from, so it sits below both."""

from __future__ import annotations

import mlx.core as mx

from .kernels.softmax import fast_logsumexp
from .sampling_params import SamplingParams


def logprobs(logits: mx.array) -> mx.array:
    # mx.logsumexp's bits, its exp vectorized on the CPU (kernels/softmax.py)
    return logits - fast_logsumexp(logits)


def filtered(lp: mx.array, params: SamplingParams) -> mx.array:
    """mlx-lm's make_sampler filter chain, in its order (top-p, min-p, top-k)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    if 0 < params.top_p < 1.0:
        lp = apply_top_p(lp, params.top_p)
    if params.min_p != 0.0:
        lp = apply_min_p(lp, params.min_p, params.min_tokens_to_keep)
    if params.top_k > 0:
        lp = apply_top_k(lp, params.top_k)
    return lp


def probs(lp: mx.array, params: SamplingParams) -> mx.array:
    """The distribution mlx-lm's categorical sampler draws from: softmax(filtered / temp)."""
    return mx.softmax(filtered(lp, params) * (1.0 / params.temp), axis=-1)
