"""Labels from one target forward, on a tiny random target: the label rule against brute-force
greedy rollouts, the soft and hard losses against hand-computed values, batched greedy
generation against mlx-lm's, and the response store (resume, refusal)."""

import math

import mlx.core as mx
import numpy as np
import pytest
from tiny import ar_greedy, tiny_model

from adaspec.train import generate
from adaspec.train.data import target_forward
from adaspec.train.generate import by_length, greedy_batch
from adaspec.train.loss import block_objective, hard_loss, soft_loss
from adaspec.train.objective import TrainingError, make_blocks
from adaspec.train.store import Answer, ResponseStore

B = 6


def _text_partly_on_chain(model, rng):
    """Random text with greedy runs spliced in, so the text joins and leaves the chain."""
    tokens = rng.integers(0, 256, size=5).tolist()
    for run in (4, 3, 5):
        tokens += ar_greedy(model, tokens, run)
        tokens += rng.integers(0, 256, size=2).tolist()
    return np.array(tokens, np.int32)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_labels_are_what_greedy_decoding_writes_after_each_anchor(arch):
    model = tiny_model(arch, seed=4)
    tokens = _text_partly_on_chain(model, np.random.default_rng(2))
    T = len(tokens)
    _, labels = target_forward(model, tokens, (0,), k=8)
    b = make_blocks(tokens, labels.greedy, np.arange(T), B, mask_id=0)
    deep = 0
    for a in range(T):
        rollout = ar_greedy(model, tokens[: a + 1].tolist(), B - 1)
        for j in range(1, B):
            # greedy verification of draft position j happens only if the text is the rollout
            # up to it, and then the token it must match is rollout[j-1]
            text = tokens[a + 1 : a + j].tolist()
            expect = a + j - 1 < T and text == rollout[: j - 1]
            assert b.valid[a, j - 1] == expect, (a, j)
            if expect:
                assert b.labels[a, j - 1] == rollout[j - 1], (a, j)
                deep += j > 1
    assert b.valid[:, 0].all() and deep > 10  # the text exercises deep labels and masks
    assert not b.valid[:, -1].all()
    # the top-k list starts with the argmax and holds log-probabilities
    assert (labels.top_ids[:, 0] == labels.greedy).all()
    assert np.all(np.diff(labels.top_logprobs, axis=1) <= 0) and (labels.top_logprobs < 0).all()


def test_soft_and_hard_losses_match_hand_computed_values():
    logits = mx.array([[[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 0.0, 3.0]]])  # (1, 2, 4)
    ids = mx.array([[[1, 0], [3, 2]]])
    logprobs = mx.array([[[math.log(0.6), math.log(0.2)], [math.log(0.5), math.log(0.5)]]])
    labels = mx.array([[1, 2]])
    weight = mx.array([[1.0, 0.5]])
    lse = mx.logsumexp(logits, axis=-1)

    z0 = math.log(math.e + math.e**2 + math.e**0.5 + math.e**-1)
    z1 = math.log(3 + math.e**3)
    # position 0: p = (0.75, 0.25) over ids (1, 0); position 1: p = (0.5, 0.5) over (3, 2)
    kl0 = 0.75 * (math.log(0.75) - (2 - z0)) + 0.25 * (math.log(0.25) - (1 - z0))
    kl1 = 0.5 * (math.log(0.5) - (3 - z1)) + 0.5 * (math.log(0.5) - (0 - z1))
    want_soft = (kl0 * 1.0 + kl1 * 0.5) / 1.5
    want_hard = ((z0 - 2) * 1.0 + (z1 - 0) * 0.5) / 1.5
    assert float(soft_loss(logits, lse, ids, logprobs, weight)) == pytest.approx(want_soft, 1e-5)
    assert float(hard_loss(logits, lse, labels, weight)) == pytest.approx(want_hard, 1e-5)
    mixed = block_objective(logits, labels, weight, 0.25, ids, logprobs)
    assert float(mixed) == pytest.approx(0.75 * want_hard + 0.25 * want_soft, 1e-5)
    assert float(block_objective(logits, labels, weight)) == pytest.approx(want_hard, 1e-5)
    # KL is zero when the drafter puts exactly the target's top-k distribution on those ids
    exact = mx.log(mx.array([[[0.25, 0.75, 1e-9, 1e-9]]]))
    zero = soft_loss(
        exact, mx.logsumexp(exact, axis=-1), ids[:, :1], logprobs[:, :1], weight[:, :1]
    )
    assert abs(float(zero)) < 1e-6


@pytest.mark.parametrize("group_tokens", [8192, 20])
def test_batched_greedy_equals_single_stream_greedy_and_stops_at_eos(monkeypatch, group_tokens):
    # prompts of equal length prefill together (in groups of at most group_tokens tokens,
    # two groups at once on two streams); the rest alone
    monkeypatch.setattr(generate, "PREFILL_TOKENS", group_tokens)
    model = tiny_model("llama", seed=2)
    rng = np.random.default_rng(0)
    sizes = (5, 17, 1, 30, 9, 12, 17, 17, 9, 17, 30)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in sizes]
    singles = [ar_greedy(model, p, 10) for p in prompts]
    eos = {singles[0][2], singles[3][5]}  # two rows end early: the batch shrinks
    got = greedy_batch(model, prompts, 10, eos, prefill_chunk=8)
    for want, g in zip(singles, got):
        stop = next((i for i, t in enumerate(want) if t in eos), None)
        assert g == (want if stop is None else want[: stop + 1])
    assert len(got[0]) == 3 and len(got[3]) <= 6
    batches = by_length([(i, p) for i, p in enumerate(prompts)], 4)
    assert [len(b) for b in batches] == [4, 4, 3] and len(batches[0][0][1]) == 30


def test_prefill_groups_hold_equal_lengths_within_the_token_budget(monkeypatch):
    monkeypatch.setattr(generate, "PREFILL_TOKENS", 64)
    groups = generate.prefill_groups([30, 5, 30, 30, 5, 100, 30], chunk=2048)
    assert sorted(map(sorted, groups)) == [[0, 2], [1, 4], [3, 6], [5]]
    assert generate.prefill_groups([100, 100], chunk=16) == [[0, 1]]  # 16-token chunks


FP = {"model_type": "llama", "vocab_size": 260, "tokenizer": "t", "weights": "w"}


def _answer(i, n):
    return Answer(f"k{i}", f"news-{i:05d}", i == 1, np.arange(n, dtype=np.int32), np.arange(3))


def test_store_round_trip_keeps_finished_shards_and_refuses_another_target(tmp_path):
    store = ResponseStore(tmp_path, FP)
    store.append([_answer(0, 4), _answer(1, 7)], max_new=16)
    store.append([_answer(2, 5)], max_new=16)
    # a job cut off while writing leaves a temporary file, which is not data
    (tmp_path / ".responses-00002.tmp").write_bytes(b"partial")
    got = ResponseStore(tmp_path, FP).load()
    assert sorted(got) == ["k0", "k1", "k2"]
    assert got["k1"].heldout and got["k1"].id == "news-00001"
    np.testing.assert_array_equal(got["k1"].prompt, np.arange(7))
    np.testing.assert_array_equal(got["k2"].response, np.arange(3))
    assert got["k0"].prompt.dtype == np.int32
    index = store.write_index()
    assert index["sequences"] == 3 and index["response_tokens"] == 9
    assert index["prompt_tokens"] == 16 and len(index["shards"]) == 2
    with pytest.raises(TrainingError, match="another target"):
        ResponseStore(tmp_path, {**FP, "weights": "other"})
