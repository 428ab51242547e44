"""Tier 2: the DFlash trainer on a tiny random target: its batched block forward equals the
drafter's inference forward, and a --tiny run ends to end (loss drops, resume, loadable)."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny import ar_greedy, byte_tokenizer, tiny_model
from tiny_dflash import ctx, tiny_config, tiny_dflash_model

from adaspec.drafters import dflash
from adaspec.drafters.dflash import DFlashDrafter
from adaspec.loop.controller import DecodeConfig, Decoder, decode
from adaspec.targets.base import target_info
from adaspec.targets.kv import KVTarget
from adaspec.train.data import (
    TargetLabels,
    TrainSeq,
    extract_features,
    load_features,
    load_labels,
    target_forward,
)
from adaspec.train.objective import TrainingError
from adaspec.train.pipeline import choose_mask_token, default_taps, train_dflash
from adaspec.train.recipe import Hyper, Recipe, tiny_recipe
from adaspec.train.trainer import Head, batch_arrays, block_logits, data_vocab


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_training_forward_equals_inference_for_every_anchor(arch):
    target = tiny_model(arch)
    info = target_info(target)
    cfg = tiny_config(info, block=6, taps=(0, 1))
    model = tiny_dflash_model(cfg, seed=3)
    tokens = np.random.default_rng(1).integers(0, 256, size=30).astype(np.int32)
    feats, labels = target_forward(target, tokens, cfg.target_layer_ids, k=4)
    feats = np.array(feats)
    # the trainer's early-exit extraction gives the features decoding computes
    via_adapter = np.array(KVTarget(target).prefill(tokens.tolist(), cfg.target_layer_ids))
    np.testing.assert_allclose(feats, via_adapter, atol=1e-4, rtol=1e-4)
    anchors = np.array([1, 7, 20, 28])
    seq = TrainSeq("s", False, tokens, 0)
    b = batch_arrays([seq, seq], [feats, feats], [labels, labels], [anchors, anchors[:2]], cfg)
    got = np.array(block_logits(model, Head(target), b))
    for i, a in enumerate([*anchors, *anchors[:2]]):
        d = DFlashDrafter(model, info)
        committed = tokens[: a + 1].tolist()
        d.prefill(committed, ctx(committed, feats[:a]))
        want = np.array(d.block_logits(cfg.block_size - 1))
        np.testing.assert_allclose(got[i], want, atol=2e-4, rtol=2e-4)


def test_extraction_on_parallel_streams_writes_what_one_forward_gives(tmp_path):
    """Sequences of different lengths go through the target two at a time on their own streams;
    each one's files equal its forward alone (features to float16 rounding)."""
    target = tiny_model("llama")
    rng = np.random.default_rng(5)
    seqs = [
        TrainSeq(f"s{i}", False, rng.integers(0, 256, size=n).astype(np.int32), n)
        for i, n in enumerate([9, 31, 17])
    ]
    extract_features(target, seqs, (0, 1), tmp_path, 4, progress=False)
    for s in seqs:
        feats, lab = target_forward(target, s.tokens, (0, 1), k=4)
        got = load_features(tmp_path, s, feats.shape[-1], 4)
        np.testing.assert_allclose(got, np.array(feats), atol=2e-3, rtol=2e-3)
        stored = load_labels(tmp_path, s, 4)
        np.testing.assert_array_equal(stored.greedy, lab.greedy)
        np.testing.assert_array_equal(stored.top_ids, lab.top_ids)


def test_hard_labels_keep_no_top_k_and_the_same_greedy_labels(tmp_path):
    """With the soft term off the forward keeps no top-k (label_k 0): the same features and
    greedy ids as with top-k, and (T, 0) top-k arrays."""
    assert Hyper(soft=0.0).label_k == 0 and Hyper(soft=0.5, topk=8).label_k == 8
    target = tiny_model("llama")
    s = TrainSeq("s", False, np.random.default_rng(6).integers(0, 256, 23).astype(np.int32), 23)
    extract_features(target, [s], (0, 1), tmp_path, 0, progress=False)
    feats, lab = target_forward(target, s.tokens, (0, 1), k=4)
    stored = load_labels(tmp_path, s, 0)
    np.testing.assert_array_equal(stored.greedy, lab.greedy)
    assert stored.top_ids.shape == stored.top_logprobs.shape == (23, 0)
    got = load_features(tmp_path, s, feats.shape[-1], 0)
    np.testing.assert_allclose(got, np.array(feats), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("tied", [True, False])
def test_data_vocabulary_head_gives_the_full_heads_columns(tied):
    target = tiny_model("llama")
    if not tied:  # an untied output projection, as most larger targets have
        target.lm_head = nn.Linear(target.args.hidden_size, target.args.vocab_size, bias=False)
    rows = np.array([3, 17, 40, 255])
    h = mx.random.normal((2, 5, target.args.hidden_size))
    full, part = Head(target), Head(target, rows)
    np.testing.assert_allclose(
        np.array(part.logits(h)), np.array(full.logits(h))[..., rows], atol=1e-5, rtol=1e-5
    )
    labs = [
        TargetLabels(np.array([5, 3, 5, 9]), np.array([[5, 1], [3, 0], [5, 1], [9, 7]]), None),
        TargetLabels(np.array([2]), np.array([[2, 4]]), None),
    ]
    np.testing.assert_array_equal(data_vocab(labs, soft=False), [2, 3, 5, 9])
    np.testing.assert_array_equal(data_vocab(labs, soft=True), [0, 1, 2, 3, 4, 5, 7, 9])


def test_default_taps_follow_zlab_rule():
    assert default_taps(30, 5) == (1, 7, 14, 20, 27)
    assert default_taps(36, 5) == (1, 9, 17, 25, 33)
    assert default_taps(2, 2) == (0, 1)


def test_tiny_run_end_to_end_loss_drops_and_resumes(tmp_path, corpus):
    target, tok = tiny_model("llama", seed=5, scale=1.0), byte_tokenizer()
    recipe = tiny_recipe(Recipe(corpus=str(corpus), head=48, hyper=Hyper(lr=3e-3)))
    out = tmp_path / "drafter"
    m = train_dflash(target, tok, out, recipe, progress=False)
    losses = [v for _, v in m["loss"]]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3])
    assert m["evals"][-1]["loss"] < m["evals"][0]["loss"]
    # held-out tau by prompt source: the sources with held-out answers, the whole in between
    last = m["evals"][-1]
    by = last["tau_by_source"]
    assert by and set(by) <= {"news", "code"}
    assert min(by.values()) - 1e-9 <= last["tau"] <= max(by.values()) + 1e-9
    assert (out / "README.md").is_file() and (out / "config.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "float16"
    assert cfg["dflash_config"]["mask_token_id"] == m["mask_token"]["id"]

    # a second run finds every stage done: nothing is regenerated or retrained
    stamp = (out / "work" / "responses" / "index.json").stat().st_mtime_ns
    again = train_dflash(target, tok, out, recipe, progress=False)
    assert again["loss"] == m["loss"]
    assert (out / "work" / "responses" / "index.json").stat().st_mtime_ns == stamp

    # the head set: the target's most frequent predictions over the training labels, EOS first
    ids = np.asarray(mx.load(str(out / "model.safetensors"))["head_token_ids"])
    assert m["head_tokens"] == len(ids) == 48 and len(set(ids.tolist())) == 48
    assert ids[0] in tok.eos_token_ids
    counts = np.zeros(target.args.vocab_size, dtype=np.int64)
    for path in (out / "work" / "features").glob("*.npz"):
        counts += np.bincount(np.load(path)["greedy"], minlength=len(counts))
    assert set(np.argsort(-counts)[:10].tolist()) <= set(ids.tolist())  # the most predicted

    # the saved drafter loads through the public path and keeps the output lossless
    info = target_info(target, tok)
    d = dflash.load(out, info)
    prompt = list(b"the river said")
    dec = Decoder(KVTarget(target), d, DecodeConfig(max_tokens=12))
    assert [e.token for e in decode(dec, prompt)] == ar_greedy(target, prompt, 12)


def test_resume_with_other_settings_is_refused(tmp_path, corpus):
    target, tok = tiny_model("llama", seed=5, scale=1.0), byte_tokenizer()
    recipe = tiny_recipe(Recipe(corpus=str(corpus)))
    train_dflash(target, tok, tmp_path, recipe, progress=False)
    from dataclasses import replace

    with pytest.raises(TrainingError, match="other settings"):
        train_dflash(
            target,
            tok,
            tmp_path,
            replace(recipe, hyper=replace(recipe.hyper, lr=1e-2)),
            progress=False,
        )
    with pytest.raises(TrainingError, match="another recipe"):
        train_dflash(target, tok, tmp_path, replace(recipe, hyper=replace(recipe.hyper, seed=9)))


def test_warm_start_from_a_checkpoint_on_the_data_vocabulary(tmp_path, corpus):
    target, tok = tiny_model("llama", seed=5, scale=1.0), byte_tokenizer()
    recipe = tiny_recipe(Recipe(corpus=str(corpus), hyper=Hyper(lr=3e-3)))
    first = train_dflash(target, tok, tmp_path / "a", recipe, progress=False)
    from dataclasses import replace

    warm = replace(recipe, init=str(tmp_path / "a"), hyper=replace(recipe.hyper, vocab="data"))
    second = train_dflash(target, tok, tmp_path / "b", warm, progress=False)
    # it starts where the first run ended (fp16 weights: a small difference), then goes on
    assert second["evals"][0]["loss"] == pytest.approx(first["evals"][-1]["loss"], rel=1e-2)
    assert second["evals"][-1]["loss"] < first["evals"][0]["loss"]
    assert np.mean([v for _, v in second["loss"][-3:]]) < np.mean([v for _, v in first["loss"][:3]])
    # the card names the run it continued by that run's record, not by a path on this machine
    card = (tmp_path / "b" / "README.md").read_text()
    assert 'warm start from the weights of the run under "Warm start"' in card
    assert (
        f"## Warm start\nThis run started from the weights of a run of {first['steps']} steps"
        in card
    )
    assert f"`{tmp_path / 'a'}`" not in card
    with pytest.raises(TrainingError, match="num_hidden_layers is 1, the recipe gives 2"):
        train_dflash(target, tok, tmp_path / "c", replace(warm, layers=2), progress=False)
    with pytest.raises(TrainingError, match="init='nowhere'"):
        Recipe(corpus=".", init="nowhere")
    with pytest.raises(TrainingError, match="vocab='some'"):
        Hyper(vocab="some")


def test_bad_recipe_and_corpus_are_refused(tmp_path):
    with pytest.raises(TrainingError, match="block=1"):
        Recipe(corpus=".", block=1)
    with pytest.raises(TrainingError, match="epochs=0"):
        Hyper(epochs=0)
    for bad in ("9-3", "3", "a-b", "-1-2"):
        with pytest.raises(TrainingError, match=f"shards='{bad}'.*FIRST-LAST"):
            Recipe(corpus=".", shards=bad)
    assert Recipe(corpus=".", shards="3-9").shard_range == range(3, 10)
    target, tok = tiny_model("llama"), byte_tokenizer()
    with pytest.raises(TrainingError, match="news.txt"):
        train_dflash(target, tok, tmp_path, tiny_recipe(Recipe(corpus=str(tmp_path))))


def test_mask_token_is_an_unused_id():
    tok = byte_tokenizer()
    tid, why = choose_mask_token(tok, 260)
    assert tid != 256 and 0 <= tid < 260 and "mask" in why


@pytest.mark.slow
def test_smollm2_mask_token_is_an_unused_special(smollm2):
    _, tok = smollm2
    tid, why = choose_mask_token(tok, 49152)
    assert tid not in (0, 1, 2)
    assert tok.convert_ids_to_tokens(tid).startswith("<")
    _ = mx  # mlx is loaded through adaspec first


def test_warm_start_takes_the_weights_at_any_block_and_refuses_another_shape(tmp_path):
    """A warm start copies every weight of a checkpoint of the same shape, also when the recipe's
    block size differs (no weight depends on it); another shape is refused, naming the field."""
    from adaspec.drafters.dflash_checkpoint import save_model
    from adaspec.train.start import init_from_checkpoint

    info = target_info(tiny_model("llama"))
    old = tiny_dflash_model(tiny_config(info, block=8), seed=4)
    save_model(old, tmp_path / "ckpt")
    new = tiny_dflash_model(tiny_config(info, block=4), seed=9)
    init_from_checkpoint(new, tmp_path / "ckpt", info)
    want = dict(tree_flatten(old.parameters()))
    for k, v in tree_flatten(new.parameters()):
        np.testing.assert_array_equal(np.array(v), np.array(want[k]), err_msg=k)
    other = tiny_dflash_model(tiny_config(info, block=8, layers=1))
    with pytest.raises(TrainingError, match="num_hidden_layers is 2, the recipe gives 1"):
        init_from_checkpoint(other, tmp_path / "ckpt", info)


def test_records_show_paths_inside_the_checkout_relative_to_it(tmp_path):
    from adaspec.train.store import checkout_root, shown_path

    root = checkout_root()
    assert root is not None  # the tests run from a checkout
    assert shown_path(root / "data" / "dflash" / "x") == "data/dflash/x"
    assert shown_path(tmp_path / "store") == str(tmp_path / "store")
