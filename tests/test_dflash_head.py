"""The DFlash drafter's restricted head: choosing the token set (pure), proposing only from it,
q a full-vocabulary distribution, lossless output, and the set in checkpoints (stored, absent,
refused when bad)."""

import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from distribution import assert_same, exact_sequences, speculative_counts
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import prompts
from tiny import VOCAB, ar_greedy, byte_tokenizer, tiny_model
from tiny_dflash import ctx, tiny_drafter

import adaspec
from adaspec import settings as settings_mod
from adaspec.drafters import dflash, shipped
from adaspec.drafters.arms import make
from adaspec.drafters.dflash import DFlashDrafter
from adaspec.drafters.dflash_checkpoint import read_checkpoint, save_model, write_head_tokens
from adaspec.drafters.restricted_head import HEAD_KEY, check_head_tokens, select_head_tokens
from adaspec.errors import DrafterError
from adaspec.loop import sampling
from adaspec.targets.base import target_info

TARGETS = {a: tiny_model(a) for a in ("llama", "qwen3")}
FEATS = np.random.default_rng(7).normal(size=(64, 128)).astype(np.float32)  # 2 taps x 64


def restricted(target, ids, **kw) -> DFlashDrafter:
    d = tiny_drafter(target, **kw)
    d.model.head_token_ids = np.asarray(ids, dtype=np.int32)
    return DFlashDrafter(d.model, target_info(target), block=d.block)


def token_sets(vocab: int):
    return st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40, unique=True)


# ---- choosing the set (pure) ---------------------------------------------------------------


@given(
    counts=st.lists(st.integers(0, 5), min_size=1, max_size=60),
    data=st.data(),
)
def test_select_head_tokens_keeps_the_most_frequent(counts, data):
    V = len(counts)
    size = data.draw(st.integers(1, V), label="size")
    always = data.draw(st.lists(st.integers(0, V - 1), max_size=3), label="always")
    ids = select_head_tokens(np.array(counts), size, always)
    first = list(dict.fromkeys(always))[:size]
    assert ids.dtype == np.int32 and len(ids) == size == len(set(ids.tolist()))
    assert ids[: len(first)].tolist() == first
    rest = ids[len(first) :]
    c = np.array(counts)
    # ordered by count, ties by id; nothing left out beats anything kept
    assert all((c[a], -a) >= (c[b], -b) for a, b in zip(rest, rest[1:]))
    left = np.setdiff1d(np.arange(V), ids)
    if len(rest) and len(left):
        worst = min((c[i], -i) for i in rest)
        assert all((c[i], -i) < worst for i in left)
    check_head_tokens(ids, V, "test")


def test_select_head_tokens_rejects_bad_arguments():
    with pytest.raises(DrafterError, match=r"head size=0 is invalid; accepted: 1..3"):
        select_head_tokens(np.ones(3), 0)
    with pytest.raises(DrafterError, match=r"always ids \[7\] are out of range; accepted: 0..2"):
        select_head_tokens(np.ones(3), 2, always=[7])
    with pytest.raises(DrafterError, match=r"shape \(2, 2\).*accepted: a non-empty 1-D"):
        select_head_tokens(np.ones((2, 2)), 1)


BAD_SETS = [
    ([3, 300, 5], r"holds id 300 out of range; accepted: ids 0..259"),
    ([-1, 2], r"holds id -1 out of range; accepted: ids 0..259"),
    ([4, 9, 4, 9, 1], r"holds ids 4, 9 more than once; accepted: distinct ids"),
    (np.array([1.0, 2.0], np.float32), r"has dtype float32; accepted: an integer dtype"),
    (mx.array([1.0, 2.0], dtype=mx.float16), r"has dtype float16; accepted: an integer dtype"),
    (np.array([True, False]), r"has dtype bool; accepted: an integer dtype"),
    (np.zeros((2, 2), np.int32), r"has shape \(2, 2\); accepted: \(n,\) with 1 <= n <= 260"),
    (np.zeros(0, np.int32), r"has shape \(0,\); accepted"),
]


@pytest.mark.parametrize("ids,msg", BAD_SETS)
def test_bad_sets_are_refused(ids, msg):
    with pytest.raises(DrafterError, match=f"where: {HEAD_KEY} " + msg):
        check_head_tokens(ids, VOCAB, "where")


# ---- proposing from the set -----------------------------------------------------------------


@settings(max_examples=15)
@given(
    arch=st.sampled_from(["llama", "qwen3"]),
    ids=token_sets(VOCAB),
    prompt=prompts(VOCAB, max_len=16),
    seed=st.integers(0, 1 << 16),
    temperature=st.sampled_from([0.0, 0.5, 1.5]),
)
def test_restricted_head_proposes_only_from_its_set(arch, ids, prompt, seed, temperature):
    target = TARGETS[arch]
    d = restricted(target, ids, seed=seed)
    d.prefill(prompt, ctx(prompt, FEATS[: len(prompt) - 1]))
    rng = np.random.default_rng(seed)
    for _ in range(3):
        draft = d.draft(ctx(prompt, temperature=temperature, rng=rng))
        assert len(draft) == d.block - 1 and set(draft.tokens) <= set(ids)
        lazy = d.draft_ids(ctx(prompt, temperature=temperature))
        if temperature > 0:  # lazy ids are greedy chains only
            assert lazy is None
        else:  # the same chain, as vocabulary ids
            assert np.array(lazy).tolist() == list(draft.tokens)
        if temperature > 0:  # q: a distribution over the full vocabulary, zero off the set
            q = draft.probs
            assert q.shape == (len(draft), VOCAB) and np.allclose(q.sum(axis=1), 1.0)
            outside = np.setdiff1d(np.arange(VOCAB), ids)
            assert (q[:, outside] == 0).all() and (q[np.arange(len(draft)), draft.tokens] > 0).all()


def _quantized():
    q = tiny_model("llama", seed=1)
    nn.quantize(q, group_size=32, bits=4)
    return q


@pytest.mark.parametrize("which", ["llama", "qwen3", "quantized"])
def test_restricted_logits_are_the_full_logits_of_the_set(which):
    target = _quantized() if which == "quantized" else TARGETS[which]
    ids = np.random.default_rng(3).permutation(VOCAB)[:50]
    full, part = tiny_drafter(target, seed=2), restricted(target, ids, seed=2)
    for d in (full, part):
        d.prefill(list(range(9)), ctx(range(9), FEATS[:8]))
    want = np.array(full.block_logits(7))[:, ids]
    np.testing.assert_allclose(np.array(part.block_logits(7)), want, rtol=1e-5, atol=1e-5)
    best = np.array(full.block_logits(7))[:, ids].argmax(axis=1)
    assert part.draft(ctx(part.tokens)).tokens == tuple(ids[best].tolist())


# ---- lossless with a restricted head ----------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("size", [1, 8, 120])
def test_greedy_output_through_generate_equals_ar(arch, size):
    target, tok = TARGETS[arch], byte_tokenizer()
    prompt = list(b"the cat sat on the mat, the cat sat")
    want = ar_greedy(target, prompt, 30)
    # the set holds some of the tokens AR emits, so some drafts are accepted
    ids = list(dict.fromkeys(want))[: max(size // 2, 1)]
    ids += [i for i in np.random.default_rng(size).permutation(VOCAB) if i not in ids]
    drafter = restricted(target, ids[:size], seed=size)
    off = settings_mod.from_env({}, gate="off")
    rs = list(
        adaspec.stream_generate(target, tok, prompt, drafter=drafter, max_tokens=30, settings=off)
    )
    ref = [r.token for r in mlx_lm.stream_generate(target, tok, prompt, max_tokens=30)]
    assert [r.token for r in rs] == ref
    assert rs[-1].stats.spec_steps > 0


V = 8
PROMPT = [1, 2, 3]
SAMPLE_TARGET = tiny_model("llama", vocab=V, seed=3, scale=0.5)


def test_speculative_sampling_with_a_restricted_head_matches_target():
    params = sampling.SamplingParams(temp=0.8)
    drafter = restricted(SAMPLE_TARGET, [5, 1, 6], seed=4, block=4)
    counts, drafted = speculative_counts(SAMPLE_TARGET, drafter, PROMPT, V, params)
    assert drafted > 0
    assert_same(counts, exact_sequences(SAMPLE_TARGET, PROMPT, V, 3, params))


# ---- the set in checkpoints -------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """One checkpoint without a head set (as z-lab's) and the same weights with one."""
    root = tmp_path_factory.mktemp("dflash_head")
    d = tiny_drafter(TARGETS["llama"], seed=6)
    d.save(root / "plain")
    counts = np.bincount(np.random.default_rng(0).integers(0, 90, 500), minlength=VOCAB)
    ids = select_head_tokens(counts, 64, always=[256])
    save_model(d.model, root / "set", dtype="float16", head_token_ids=ids)
    return root / "plain", root / "set", ids


def test_checkpoint_without_a_set_loads_as_before(ckpts):
    plain, _, _ = ckpts
    assert HEAD_KEY not in mx.load(str(plain / "model.safetensors"))
    d = dflash.load(plain, target_info(TARGETS["llama"]))
    assert d.model.head_token_ids is None and d.head.ids is None and d.head.size == VOCAB
    d.prefill(list(range(9)), ctx(range(9), FEATS[:8]))
    assert d.block_logits(3).shape == (3, VOCAB)


def test_checkpoint_set_round_trip_and_head_argument(ckpts, tmp_path):
    _, path, ids = ckpts
    info = target_info(TARGETS["llama"])
    stored = mx.load(str(path / "model.safetensors"))[HEAD_KEY]
    assert stored.dtype == mx.int32 and np.array_equal(np.array(stored), ids)
    assert ids[0] == 256  # `always` first
    s = settings_mod.from_env({})
    d = make(f"dflash:{path}", info, s)
    assert np.array_equal(d.head.ids, ids) and d.head.size == 64
    assert np.array_equal(make(f"dflash:{path},head=10", info, s).head.ids, ids[:10])
    assert make(f"dflash:{path},head=0", info, s).head.ids is None
    with pytest.raises(DrafterError, match=r"head=65 is invalid .* holds 64 ids; accepted: 0 .*"):
        make(f"dflash:{path},head=65", info, s)
    d.save(tmp_path / "again")  # the drafter's save keeps the stored set
    assert np.array_equal(dflash.load(tmp_path / "again", info).head.ids, ids)


def test_head_argument_needs_a_stored_set(ckpts):
    plain, _, _ = ckpts
    with pytest.raises(DrafterError, match=r"head=8 is invalid .* holds none; accepted: 0 \("):
        make(f"dflash:{plain},head=8", target_info(TARGETS["llama"]), settings_mod.from_env({}))


@pytest.mark.parametrize("ids,msg", BAD_SETS[:4] + BAD_SETS[6:])
def test_checkpoint_with_a_bad_set_is_refused(ckpts, tmp_path, ids, msg):
    plain, _, _ = ckpts
    out = tmp_path / "bad"
    shutil.copytree(plain, out)
    w = dict(mx.load(str(out / "model.safetensors")))
    w[HEAD_KEY] = mx.array(np.asarray(ids))
    mx.save_safetensors(str(out / "model.safetensors"), w)
    with pytest.raises(DrafterError, match=f"DFlash checkpoint '{out}': {HEAD_KEY} " + msg):
        dflash.load(out, target_info(TARGETS["llama"]))


def test_save_refuses_a_bad_set(tmp_path):
    d = tiny_drafter(TARGETS["llama"])
    with pytest.raises(DrafterError, match=r"save_model: head_token_ids holds id 999 out of"):
        save_model(d.model, tmp_path / "x", head_token_ids=np.array([1, 999]))


def test_write_head_tokens_adds_replaces_and_removes_a_set(ckpts, tmp_path):
    plain, _, _ = ckpts
    out = tmp_path / "zlab"
    shutil.copytree(plain, out)
    before = dict(mx.load(str(out / "model.safetensors")))
    info = target_info(TARGETS["llama"])
    write_head_tokens(out, np.array([5, 3, 9]))
    assert dflash.load(out, info).head.ids.tolist() == [5, 3, 9]
    write_head_tokens(out, np.array([7]))
    after = dict(mx.load(str(out / "model.safetensors")))
    assert np.array(after.pop(HEAD_KEY)).tolist() == [7] and after.keys() == before.keys()
    assert all(np.array_equal(np.array(after[k]), np.array(before[k])) for k in before)
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(DrafterError, match=r"holds id 1 more than once; accepted: distinct ids"):
        write_head_tokens(out, np.array([1, 1]))
    write_head_tokens(out, None)
    assert dflash.load(out, info).head.ids is None


def test_shipped_smollm2_drafter_has_a_head_set():
    cfg, _, ids = read_checkpoint(shipped.CHECKPOINTS / "smollm2-135m-dflash")
    assert len(ids) == 16384 and ids[:2].tolist() == [0, 2]  # its end-of-text ids lead
