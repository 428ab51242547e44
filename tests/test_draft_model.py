"""Tier 2: the draft-model drafter on tiny random pairs: lossless contract, its own cache under
random commit/rollback, vocabulary checks, and rejection sampling with q (distribution and
acceptance against sample-and-match)."""

import mlx.core as mx
import numpy as np
import pytest
from distribution import assert_same, exact_sequences
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from strategies import prompts
from tiny import VOCAB, ar_greedy, byte_tokenizer, save_tiny, tiny_model

from adaspec.drafters.arms import make as make_drafter
from adaspec.drafters.arms import make_arms
from adaspec.drafters.base import DraftContext, DraftModel
from adaspec.drafters.draft_model import ENTRY, DraftLM
from adaspec.drafters.spec import parse_arm
from adaspec.errors import DrafterError, DrafterMismatchError
from adaspec.loop import sampling
from adaspec.loop.controller import AlwaysSpeculate, DecodeConfig, Decoder, decode
from adaspec.settings import from_env
from adaspec.targets.base import target_info
from adaspec.targets.kv import KVTarget

TOK = byte_tokenizer()
TARGETS = {a: tiny_model(a) for a in ("llama", "qwen3")}
# drafters: other weights, other depth; 258 and 300 rows share the target's 257-token tokenizer
DRAFTS = {
    (a, rows): tiny_model(a, vocab=rows, seed=7, layers=1)
    for a in ("llama", "qwen3")
    for rows in (258, VOCAB, 300)
}


def drafter(model, target, **kw) -> DraftLM:
    return DraftLM(model, TOK, target_info(target, TOK), **kw)


def ctx(tokens, k=0, params=None, rng=None) -> DraftContext:
    return DraftContext(
        tokens=tokens,
        max_draft=k,
        temperature=params.temp if params else 0.0,
        rng=rng or np.random.default_rng(0),
        sampling=params,
    )


# ---- contract: greedy output == mlx-lm greedy AR, whatever the draft model -------------------


@settings(max_examples=20)
@given(
    arch=st.sampled_from(["llama", "qwen3"]),
    rows=st.sampled_from([258, VOCAB, 300]),
    prompt=prompts(VOCAB),
    max_tokens=st.integers(1, 24),
    k=st.integers(1, 8),
    min_p1=st.sampled_from([0.0, 0.3]),
)
def test_greedy_output_equals_ar(arch, rows, prompt, max_tokens, k, min_p1):
    target = TARGETS[arch]
    d = drafter(DRAFTS[arch, rows], target, min_p1=min_p1)
    dec = Decoder(KVTarget(target, TOK), d, DecodeConfig(max_tokens=max_tokens, max_draft=k))
    out = [e.token for e in decode(dec, prompt)]
    assert out == ar_greedy(target, prompt, max_tokens)
    assert d.tokens == dec.committed == prompt + out
    assert len(d.cached) <= len(d.tokens) - 1 + k  # at most the last draft beyond the prefix


@settings(max_examples=8)
@given(prompt=prompts(VOCAB), max_tokens=st.integers(4, 30), k=st.integers(1, 8))
def test_draft_model_equal_to_target_gets_every_draft_accepted(tiny, prompt, max_tokens, k):
    d = drafter(tiny, tiny)
    dec = Decoder(KVTarget(tiny, TOK), d, DecodeConfig(max_tokens=max_tokens, max_draft=k))
    out = [e.token for e in decode(dec, prompt)]
    assert out == ar_greedy(tiny, prompt, max_tokens)
    assert dec.stats.drafted > 0 and dec.stats.accepted == dec.stats.drafted


def test_consumer_stopping_early_keeps_the_view():
    target = TARGETS["llama"]
    d = drafter(DRAFTS["llama", VOCAB], target)
    dec = Decoder(KVTarget(target, TOK), d, DecodeConfig(max_tokens=20, max_draft=5))
    events = decode(dec, [5, 6, 7])
    got = [next(events).token for _ in range(7)]
    events.close()
    ref = ar_greedy(target, [5, 6, 7], 8)
    assert got == ref[:7] and d.tokens == dec.committed == [5, 6, 7, *got]
    new, *_ = dec.step(1)  # both caches are usable: one more step continues the AR sequence
    assert new == ref[7:]


def test_draft_length_follows_the_budget_and_min_p1_ends_drafts_early():
    target = TARGETS["qwen3"]
    d = drafter(DRAFTS["qwen3", 300], target)
    d.prefill([1, 2, 3], ctx([1, 2, 3]))
    assert [len(d.draft(ctx(d.tokens, k))) for k in (0, 1, 5)] == [0, 1, 5]
    assert all(t < VOCAB for t in d.draft(ctx(d.tokens, 8)).tokens)  # never a padded id
    assert isinstance(d, DraftModel) and d.vocab_size == VOCAB and d.n_ids == VOCAB
    sure = drafter(DRAFTS["qwen3", 300], target, min_p1=0.999)
    sure.prefill([1, 2, 3], ctx([1, 2, 3]))
    assert len(sure.draft(ctx(sure.tokens, 8))) == 1  # the first token is always proposed


# ---- stateful: the drafter's own cache under random draft / commit / rollback -----------------


class CacheMachine(RuleBasedStateMachine):
    """A drafter driven step by step must predict what one prefilled from scratch with the
    committed sequence predicts."""

    @initialize(arch=st.sampled_from(["llama", "qwen3"]), prompt=prompts(VOCAB, 12))
    def start(self, arch, prompt):
        self.target = TARGETS[arch]
        self.model = DRAFTS[arch, 300]
        self.d = drafter(self.model, self.target)
        self.d.prefill(prompt, ctx(prompt))
        self.tokens = list(prompt)

    @precondition(lambda self: hasattr(self, "tokens") and len(self.tokens) < 120)
    @rule(data=st.data(), k=st.integers(0, 6), sampled=st.booleans())
    def draft_and_commit(self, data, k, sampled):
        params = sampling.SamplingParams(temp=0.9) if sampled else None
        d = self.d.draft(ctx(self.tokens, k, params, np.random.default_rng(k)))
        a = data.draw(st.integers(0, len(d)), label="accepted")
        new = [*d.tokens[:a], data.draw(st.integers(0, VOCAB - 1), label="bonus")]
        self.d.advance(new, ctx(self.tokens + new))
        self.tokens += new

    @precondition(lambda self: hasattr(self, "tokens"))
    @rule(data=st.data())
    def rollback(self, data):
        n = data.draw(st.integers(0, len(self.tokens) - 1), label="n")
        self.d.rollback(n)
        del self.tokens[len(self.tokens) - n :]

    @precondition(lambda self: hasattr(self, "tokens") and len(self.tokens) < 120)
    @rule(new=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9))
    def commit_without_drafting(self, new):
        """Floored steps: committed tokens the drafter never drafted (caught up later)."""
        self.d.advance(new, ctx(self.tokens + new))
        self.tokens += new

    @invariant()
    def same_view_and_logits_as_a_fresh_prefill(self):
        if not hasattr(self, "tokens"):
            return
        assert self.d.tokens == self.tokens
        fresh = drafter(self.model, self.target)
        fresh.prefill(self.tokens, ctx(self.tokens))
        np.testing.assert_allclose(
            np.array(self.d.next_logits()), np.array(fresh.next_logits()), atol=1e-4, rtol=1e-4
        )
        assert len(self.d.cached) == len(self.tokens)


CacheMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=10)
TestCacheMachine = CacheMachine.TestCase


@settings(max_examples=10)
@given(
    arch=st.sampled_from(["llama", "qwen3"]),
    rows=st.sampled_from([VOCAB, 300]),  # 300: a draft model with padded embedding rows
    head=st.integers(1, VOCAB),
    prompt=prompts(VOCAB),
    max_tokens=st.integers(1, 20),
    k=st.integers(1, 6),
)
@example(arch="llama", rows=VOCAB, head=VOCAB - 2, prompt=[0], max_tokens=1, k=1)  # <eos> inside
def test_a_restricted_head_proposes_only_its_ids_and_stays_lossless(
    arch, rows, head, prompt, max_tokens, k
):
    target, model = TARGETS[arch], DRAFTS[arch, rows]
    # <eos> (256) first, then the lowest other ids: head ids in all
    kept = {256, *[i for i in range(VOCAB) if i != 256][: head - 1]}
    d = drafter(model, target, head=head)
    d.prefill(prompt, ctx(prompt))
    full = drafter(model, target)
    full.prefill(prompt, ctx(prompt))
    got, ref = np.array(d.next_logits()), np.array(full.next_logits())
    inside = np.isfinite(got)
    assert set(np.flatnonzero(inside).tolist()) == kept
    np.testing.assert_allclose(got[inside], ref[inside], rtol=1e-5, atol=1e-5)
    d = drafter(model, target, head=head)
    dec = Decoder(KVTarget(target, TOK), d, DecodeConfig(max_tokens=max_tokens, max_draft=k))
    out = [e.token for e in decode(dec, prompt)]
    assert out == ar_greedy(target, prompt, max_tokens)
    assert set(d.draft(ctx(d.tokens, k)).tokens) <= kept  # from the committed view
    rng = np.random.default_rng(1)  # sampled drafts: q is zero outside the kept ids
    draft = d.draft(ctx(d.tokens, k, sampling.SamplingParams(temp=1.0), rng))
    assert set(draft.tokens) <= kept
    outside = [i for i in range(VOCAB) if i not in kept]
    assert not np.asarray(draft.probs)[:, outside].any()


def test_a_bad_head_size_is_refused_naming_it():
    target = TARGETS["llama"]
    for bad in (-1, VOCAB + 1):
        msg = rf"head={bad} is invalid; accepted: 0 .* 1\.\.{VOCAB}"
        with pytest.raises(DrafterError, match=msg):
            drafter(DRAFTS["llama", VOCAB], target, head=bad)
    with pytest.raises(DrafterError, match="head='x' is not an integer"):
        ENTRY.build(parse_arm("draft-model:m,head=x"), target_info(target, TOK), from_env({}))


def test_catch_up_after_a_floor_is_reported_as_setup():
    target = TARGETS["llama"]
    d = drafter(DRAFTS["llama", VOCAB], target)
    d.prefill([1, 2, 3], ctx([1, 2, 3]))
    assert d.draft(ctx(d.tokens, 2)).setup_s == 0.0
    d.advance([4, 5, 6, 7, 8, 9], ctx(d.tokens))
    caught_up = d.draft(ctx(d.tokens, 2))
    fresh = drafter(DRAFTS["llama", VOCAB], target)
    fresh.prefill(d.tokens, ctx(d.tokens))
    assert caught_up.setup_s > 0 and caught_up.tokens == fresh.draft(ctx(d.tokens, 2)).tokens


def test_rollback_out_of_range_and_draft_before_prefill():
    d = drafter(DRAFTS["llama", VOCAB], TARGETS["llama"])
    with pytest.raises(DrafterError, match="before prefill"):
        d.draft(ctx([1], 2))
    d.prefill([1, 2, 3], ctx([1, 2, 3]))
    with pytest.raises(DrafterError, match=r"rollback\(4\) out of range; accepted: 0..3"):
        d.rollback(4)


# ---- vocabulary: same tokenizer required, padded embedding rows allowed -----------------------


class VocabOnly:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_mismatched_tokenizer_is_refused_naming_both_sizes():
    target_vocab = TOK.get_vocab()
    other = {t: (i + 1) % len(target_vocab) for t, i in target_vocab.items()}  # ids shifted
    info = target_info(TARGETS["llama"], TOK)
    with pytest.raises(DrafterMismatchError, match=r"258 embedding rows and 257 tokenizer tok"):
        DraftLM(DRAFTS["llama", 258], VocabOnly(other), info)
    bigger = {**target_vocab, "<extra>": 257}
    with pytest.raises(DrafterMismatchError, match=r"target 260 rows and 257 tokenizer tokens"):
        DraftLM(DRAFTS["llama", 258], VocabOnly(bigger), info)


class CountedVocab(VocabOnly):
    reads = 0

    def get_vocab(self) -> dict[str, int]:
        self.reads += 1
        return super().get_vocab()


def test_a_pair_of_tokenizers_is_read_once_when_it_agrees():
    from adaspec.drafters import draft_model

    info = target_info(TARGETS["llama"], TOK)
    same, shifted = CountedVocab(TOK.get_vocab()), CountedVocab({"a": 1, "b": 0})
    for _ in range(3):
        DraftLM(DRAFTS["llama", 258], same, info)
        with pytest.raises(DrafterMismatchError):
            DraftLM(DRAFTS["llama", 258], shifted, info)
    assert (same.reads, shifted.reads) == (1, 3)  # a refusal is never remembered
    kept = [CountedVocab(TOK.get_vocab()) for _ in range(draft_model.AGREEING_KEPT + 1)]
    for tok in kept:
        DraftLM(DRAFTS["llama", 258], tok, info)
    assert len(draft_model._AGREEING) == draft_model.AGREEING_KEPT  # the oldest pairs go
    DraftLM(DRAFTS["llama", 258], kept[0], info)
    assert kept[0].reads == 2


def test_without_tokenizers_the_row_counts_must_match():
    small = tiny_model("llama", vocab=12, seed=2)
    with pytest.raises(DrafterMismatchError, match="12 embedding rows, the target 260 rows"):
        DraftLM(small, None, target_info(TARGETS["llama"]))
    assert DraftLM(DRAFTS["llama", VOCAB], None, target_info(TARGETS["llama"])).n_ids == VOCAB


def test_registry_loads_a_model_folder(tmp_path):
    folder = save_tiny(DRAFTS["qwen3", 300], TOK, tmp_path / "draft")
    s = from_env({}, cache=str(tmp_path / "cache"))
    info = target_info(TARGETS["qwen3"], TOK)
    d = make_drafter(f"draft-model:{folder},min_p1=0.2,q=0", info, s)
    assert isinstance(d, DraftLM) and d.min_p1 == 0.2 and d.n_ids == VOCAB and not d.send_q
    d.prefill([1, 2], ctx([1, 2]))
    assert d.draft(ctx([1, 2], 3, sampling.SamplingParams(temp=1.0))).probs is None
    with pytest.raises(DrafterError, match="draft-model needs a model"):
        make_drafter("draft-model", target_info(TARGETS["qwen3"], TOK), s)


# ---- sampling: rejection sampling with q keeps the target's distribution ----------------------

V = 8
PROMPT = [1, 2, 3]
S_TARGET = tiny_model("llama", vocab=V, seed=3, scale=0.5)
S_DRAFT = tiny_model("llama", vocab=V, seed=4, scale=0.5, layers=1)


def run_many(make, params, n, max_tokens=2, k=2):
    counts, drafted, accepted = np.zeros(V**max_tokens), 0, 0
    for s in range(n):
        dec = Decoder(
            KVTarget(S_TARGET),
            make(),
            DecodeConfig(max_tokens=max_tokens, sampling=params, max_draft=k),
            AlwaysSpeculate(),
            rng=np.random.default_rng(s),
        )
        toks = [e.token for e in decode(dec, PROMPT)]
        counts[int(np.ravel_multi_index(toks, (V,) * max_tokens))] += 1
        drafted, accepted = drafted + dec.stats.drafted, accepted + dec.stats.accepted
    return counts, accepted / drafted


@pytest.mark.parametrize(
    "params",
    [sampling.SamplingParams(temp=0.7), sampling.SamplingParams(temp=1.0, top_p=0.9, top_k=5)],
    ids=["T0.7", "T1-top_p-top_k"],
)
def test_rejection_sampling_with_q_keeps_the_target_distribution(params):
    counts, _ = run_many(lambda: DraftLM(S_DRAFT, None, target_info(S_TARGET)), params, 1500)
    assert_same(counts, exact_sequences(S_TARGET, PROMPT, V, 2, params))


def test_sampled_drafts_are_draws_from_the_filtered_q():
    params = sampling.SamplingParams(temp=0.8, top_k=4)
    d = DraftLM(S_DRAFT, None, target_info(S_TARGET))
    d.prefill(PROMPT, ctx(PROMPT))
    rng = np.random.default_rng(1)
    drafts = [d.draft(ctx(PROMPT, 1, params, rng)) for _ in range(600)]
    q = drafts[0].probs[0]
    logits = S_DRAFT(mx.array(PROMPT)[None])[0, -1:]
    want = np.array(sampling.probs(sampling.logprobs(logits), params))[0]
    np.testing.assert_allclose(q, want, atol=1e-6)
    assert (q > 0).sum() == 4
    assert_same(np.bincount([x.tokens[0] for x in drafts], minlength=V).astype(float), q)


def test_rejection_sampling_accepts_more_than_sample_and_match():
    params = sampling.SamplingParams(temp=0.7)
    info = target_info(S_TARGET)
    _, rs = run_many(lambda: DraftLM(S_DRAFT, None, info), params, 300)
    _, sm = run_many(lambda: DraftLM(S_DRAFT, None, info, send_q=False), params, 300)
    assert rs > sm + 0.2, (rs, sm)


def test_auto_puts_pld_in_front_of_a_draft_model_and_stays_lossless(tmp_path):
    """auto:draft-model:DIR: PLD on a long enough match, the small model otherwise."""
    from adaspec.drafters.pld import PromptLookup
    from adaspec.policy.adaptive import GatedPolicy, PolicyConfig

    folder = save_tiny(DRAFTS["qwen3", 300], TOK, tmp_path / "draft")
    s = from_env({}, cache=str(tmp_path / "cache"))
    target = TARGETS["qwen3"]
    info = target_info(target, TOK)
    spec = f"auto:draft-model:{folder},min_p1=0.2,min_match=2"
    pld, sfx, lm = make_arms(spec, info, s)
    assert isinstance(pld, PromptLookup) and isinstance(lm, DraftLM) and sfx.name == "suffix"
    pld, lm = make_arms(spec + ",suffix=false", info, s)
    assert isinstance(pld, PromptLookup) and isinstance(lm, DraftLM)
    assert pld.min_ngram == 2 and lm.min_p1 == 0.2
    prompt = [5, 6, 7, 8, 9, 10, 11] * 3 + [40, 41]
    pol = GatedPolicy(PolicyConfig())
    dec = Decoder(KVTarget(target), [pld, lm], DecodeConfig(max_tokens=30), pol)
    out = [e.token for e in decode(dec, prompt)]
    assert out == ar_greedy(target, prompt, 30)
    assert dec.stats.by_arm["draft-model"]["steps"] > 0 and pld.tokens == prompt + out
    with pytest.raises(DrafterError, match="PLD and suffix lookup already come first"):
        make_drafter("auto:pld", info, s)
