"""Tier 2: the DFlash drafter on tiny random targets: lossless contract, context invariant under
random commit/rollback, sampling, a numpy re-computation, and the context window (checkpoints:
test_dflash_checkpoint.py)."""

import mlx.core as mx
import numpy as np
import pytest
from distribution import assert_same, exact_sequences, speculative_counts
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from strategies import prompts
from tiny import VOCAB, ar_greedy, tiny_model
from tiny_dflash import (
    assert_context_matches_fresh_prefill,
    ctx,
    params_of,
    reference_logits,
    tiny_config,
    tiny_dflash_model,
    tiny_drafter,
)

from adaspec.drafters import dflash
from adaspec.drafters.base import DraftModel
from adaspec.drafters.dflash import DFlashDrafter
from adaspec.errors import DrafterError
from adaspec.loop import sampling
from adaspec.loop.controller import DecodeConfig, Decoder, decode
from adaspec.targets.base import target_info
from adaspec.targets.kv import KVTarget

TARGETS = {a: tiny_model(a) for a in ("llama", "qwen3")}
SMALL_V = {a: tiny_model(a, vocab=12, seed=2) for a in ("llama", "qwen3")}
FEATS = np.random.default_rng(7).normal(size=(200, 128)).astype(np.float32)  # 2 taps x 64


def embed_head(target):
    w = np.array(target.model.embed_tokens.weight, dtype=np.float64)
    return w, w  # the tiny targets tie their embeddings


# ---- (a) contract: greedy output == mlx-lm greedy AR for any drafter weights ----------------


@settings(max_examples=20)
@given(
    arch=st.sampled_from(["llama", "qwen3"]),
    small_vocab=st.booleans(),
    prompt=prompts(12, max_len=20),
    max_tokens=st.integers(1, 24),
    seed=st.integers(0, 1 << 16),
    block=st.integers(2, 10),
    window=st.sampled_from([3, 8, 2048]),
)
def test_greedy_output_equals_ar(arch, small_vocab, prompt, max_tokens, seed, block, window):
    target = (SMALL_V if small_vocab else TARGETS)[arch]
    drafter = tiny_drafter(target, seed=seed, block=block, window=window, sink=min(2, window - 1))
    dec = Decoder(KVTarget(target), drafter, DecodeConfig(max_tokens=max_tokens))
    out = [e.token for e in decode(dec, prompt)]
    assert out == ar_greedy(target, prompt, max_tokens)
    assert drafter.tokens == dec.committed == prompt + out
    assert drafter.cache.length == len(dec.committed) - 1
    assert dec.stats.drafted <= dec.stats.spec_steps * (drafter.block - 1)
    assert_context_matches_fresh_prefill(target, drafter, dec.committed)


@settings(max_examples=8)
@given(prompt=prompts(12, max_len=12), stop_after=st.integers(1, 12), seed=st.integers(0, 99))
def test_consumer_stopping_early_keeps_context_invariant(prompt, stop_after, seed):
    target = SMALL_V["qwen3"]
    drafter = tiny_drafter(target, seed=seed)
    dec = Decoder(KVTarget(target), drafter, DecodeConfig(max_tokens=16))
    events = decode(dec, prompt)
    got = [next(events).token for _ in range(stop_after)]
    events.close()
    assert drafter.tokens == dec.committed == prompt + got
    assert drafter.cache.length == len(dec.committed) - 1


def test_draft_length_is_block_minus_one_capped_by_budget():
    target = TARGETS["llama"]
    d = tiny_drafter(target, block=6)
    d.prefill([1, 2, 3], ctx([1, 2, 3], FEATS[:2]))
    assert len(d.draft(ctx(d.tokens, max_draft=64))) == 5
    assert len(d.draft(ctx(d.tokens, max_draft=3))) == 3
    assert len(d.draft(ctx(d.tokens, max_draft=0))) == 0
    # the lazy chain: the same ids; none for no room, a tree or sampling
    assert np.array(d.draft_ids(ctx(d.tokens, max_draft=3))).tolist() == list(
        d.draft(ctx(d.tokens, max_draft=3)).tokens
    )
    assert d.draft_ids(ctx(d.tokens, max_draft=0)) is None
    assert d.draft_ids(ctx(d.tokens, max_draft=3, tree_nodes=4)) is None
    assert d.needs_taps == (0, 1) and d.vocab_size == VOCAB
    assert isinstance(d, DraftModel)


# ---- (b) stateful: random draft/accept/rollback programs vs a list model -------------------


class ContextMachine(RuleBasedStateMachine):
    """Features depend only on the position, so a drafter prefilled from scratch with the
    committed sequence must give the same block logits as the one driven step by step."""

    @initialize(
        arch=st.sampled_from(["llama", "qwen3"]),
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
        small_window=st.booleans(),
    )
    def start(self, arch, prompt, small_window):
        self.target = TARGETS[arch]
        window, sink = (5, 2) if small_window else (2048, 4)
        self.drafter = tiny_drafter(self.target, window=window, sink=sink, block=5)
        self.drafter.prefill(prompt, ctx(prompt, FEATS[: len(prompt) - 1]))
        self.tokens = list(prompt)

    @precondition(lambda self: hasattr(self, "tokens") and len(self.tokens) < 150)
    @rule(data=st.data())
    def draft_and_commit(self, data):
        d = self.drafter.draft(ctx(self.tokens, max_draft=data.draw(st.integers(0, 6))))
        a = data.draw(st.integers(0, len(d)), label="accepted")
        new = [*d.tokens[:a], data.draw(st.integers(0, VOCAB - 1), label="bonus")]
        L = len(self.tokens)
        self.drafter.advance(new, ctx(self.tokens + new, FEATS[L - 1 : L - 1 + len(new)]))
        self.tokens += new

    @precondition(lambda self: hasattr(self, "tokens"))
    @rule(data=st.data())
    def rollback(self, data):
        n = data.draw(st.integers(0, len(self.tokens) - 1), label="n")
        self.drafter.rollback(n)
        del self.tokens[len(self.tokens) - n :]

    @invariant()
    def views_agree_and_context_is_committed_minus_one(self):
        if hasattr(self, "tokens"):
            assert self.drafter.tokens == self.tokens
            assert self.drafter.cache.length == len(self.tokens) - 1

    @invariant()
    def same_logits_as_a_fresh_prefill(self):
        if not hasattr(self, "tokens"):
            return
        d = self.drafter
        fresh = DFlashDrafter(
            d.model, target_info(self.target), window=d.window, sink=d.sink, block=d.block
        )
        fresh.prefill(self.tokens, ctx(self.tokens, FEATS[: len(self.tokens) - 1]))
        np.testing.assert_allclose(
            np.array(d.block_logits(4)), np.array(fresh.block_logits(4)), atol=1e-4, rtol=1e-4
        )


ContextMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=12)
TestContextMachine = ContextMachine.TestCase


def test_rollback_out_of_range_and_zero():
    d = tiny_drafter(TARGETS["llama"])
    d.prefill([1, 2, 3], ctx([1, 2, 3], FEATS[:2]))
    before = np.array(d.block_logits(3))
    d.rollback(0)
    np.testing.assert_array_equal(np.array(d.block_logits(3)), before)
    with pytest.raises(DrafterError, match=r"rollback\(4\) out of range; accepted: 0..3"):
        d.rollback(4)


def test_missing_features_rejected():
    d = tiny_drafter(TARGETS["llama"])
    with pytest.raises(DrafterError, match="tap features of shape None"):
        d.prefill([1, 2, 3], ctx([1, 2, 3], None))
    with pytest.raises(DrafterError, match=r"shape \(1, 128\); accepted: at least 2 rows"):
        d.prefill([1, 2, 3], ctx([1, 2, 3], FEATS[:1]))


# ---- (c) sampling: T>0 drafts are draws from q, and the output follows the target ----------

V = 8
PROMPT = [1, 2, 3]
SAMPLE_TARGET = tiny_model("llama", vocab=V, seed=3, scale=0.5)


def test_sampled_drafts_are_draws_from_q():
    d = tiny_drafter(SAMPLE_TARGET)
    d.prefill(PROMPT, ctx(PROMPT, FEATS[:2]))
    rng = np.random.default_rng(1)
    drafts = [d.draft(ctx(PROMPT, max_draft=2, temperature=0.8, rng=rng)) for _ in range(600)]
    q = drafts[0].probs
    assert q.shape == (2, V) and np.allclose(q.sum(1), 1)
    assert all(np.array_equal(x.probs, q) for x in drafts)  # q depends on the state only
    for i in range(2):
        assert_same(np.bincount([x.tokens[i] for x in drafts], minlength=V).astype(float), q[i])


def test_speculative_sampling_with_dflash_matches_target():
    params = sampling.SamplingParams(temp=0.8, top_p=0.9)
    drafter = tiny_drafter(SAMPLE_TARGET, seed=4, block=4)
    counts, drafted = speculative_counts(SAMPLE_TARGET, drafter, PROMPT, V, params)
    assert drafted > 0
    assert_same(counts, exact_sequences(SAMPLE_TARGET, PROMPT, V, 3, params))


# ---- (e) an independent numpy re-computation of one forward --------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("layer_types", [None, ("sliding_attention", "full_attention")])
def test_forward_matches_numpy_reference(arch, layer_types):
    target = TARGETS[arch]
    over = dict(layer_types=layer_types, sliding_window=6) if layer_types else {}
    d = tiny_drafter(target, seed=5, block=7, rope_theta=500.0, **over)
    prompt = [5, 9, 200, 3, 3, 17, 42, 8, 1, 77, 6]
    d.prefill(prompt, ctx(prompt, FEATS[: len(prompt) - 1]))
    got = np.array(d.block_logits(6))
    embed, head = embed_head(target)
    S = len(prompt) - 1
    want = reference_logits(
        d.cfg, params_of(d.model), embed, head, FEATS[:S], np.arange(S), prompt[-1], S, 7
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---- (f) the context window changes which rows are attended, nothing else ------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_window_selects_sink_and_recent_rows_at_absolute_positions(arch):
    target = TARGETS[arch]
    cfg = tiny_config(target_info(target), block=5)
    model = tiny_dflash_model(cfg, seed=9)
    info = target_info(target)
    prompt = list(range(40, 70))  # 29 context rows
    S = len(prompt) - 1

    def logits(window, sink, feats=FEATS[:S], positions=None):
        d = DFlashDrafter(model, info, window=window, sink=sink)
        d.prefill(prompt, ctx(prompt, feats))
        if positions is not None:  # rebuild the context from the chosen rows only
            d.cache = dflash.ContextCache(model)
            for p in positions:
                d.cache.append(model.context_kv(mx.array(FEATS[p : p + 1]), int(p)))
        return np.array(d.block_logits(4))

    full = logits(2048, 4)
    np.testing.assert_array_equal(logits(S, 4), full)  # window >= context: all rows attended
    small = logits(8, 3)
    kept = [0, 1, 2, *range(S - 5, S)]
    np.testing.assert_allclose(small, logits(2048, 0, positions=kept), atol=1e-5, rtol=1e-5)
    assert not np.allclose(small, full, atol=1e-3)  # the window did change the attended rows
    # and the numpy reference with the same rows at the same absolute positions agrees
    embed, head = embed_head(target)
    want = reference_logits(
        cfg, params_of(model), embed, head, FEATS[kept], np.array(kept), prompt[-1], S, 5
    )
    np.testing.assert_allclose(small, want, rtol=1e-4, atol=1e-4)
