"""Tier 2: tree verify on tiny attention targets against one plain forward per branch, and
what stays chain-only."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import token_trees
from tiny import VOCAB, tiny_model
from tiny_recurrent import tiny_hybrid

from adaspec.errors import TargetError
from adaspec.targets import make_target
from adaspec.targets.kv import KVTarget


def tiny_qwen2():
    """qwen2: biased q/k/v projections, no q/k norms."""
    from mlx_lm.models import qwen2

    mx.random.seed(4)
    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    model = qwen2.Model(args)
    mx.eval(model.parameters())
    return model


MODELS = {a: tiny_model(a) for a in ("llama", "qwen3")} | {"qwen2": tiny_qwen2()}
TAPS = (0, 1)


def _branch(model, prompt, fed):
    """Logits and tap features of the last of `fed`, fed as a plain chain after `prompt`."""
    t = KVTarget(model)
    t.prefill(prompt)
    out = t.forward(fed, TAPS)
    return np.array(out.logits[-1]), np.array(out.features[-1])


@settings(max_examples=12)
@given(
    arch=st.sampled_from(sorted(MODELS)),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    root=st.integers(0, VOCAB - 1),
    tree=token_trees(VOCAB, max_nodes=9),
)
def test_tree_rows_equal_a_plain_forward_of_each_branch(arch, prompt, root, tree):
    model = MODELS[arch]
    tokens, parents = tree
    t = KVTarget(model, prefill_step=5)
    t.prefill(prompt)
    out = t.forward_tree([root, *tokens], parents, TAPS)
    logits, feats = np.array(out.logits), np.array(out.features)
    assert logits.shape[0] == len(tokens) + 1 and t.offset == len(prompt) + len(tokens) + 1
    paths = [[root]]
    for i, p in enumerate(parents):
        paths.append(paths[p + 1] + [tokens[i]])
    for row, fed in enumerate(paths):
        want_logits, want_feats = _branch(model, prompt, fed)
        np.testing.assert_allclose(logits[row], want_logits, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(feats[row], want_feats, atol=1e-4, rtol=1e-4)


def test_attention_modules_are_restored_even_after_an_error():
    model = MODELS["qwen3"]
    before = [layer.self_attn for layer in model.model.layers]
    t = KVTarget(model)
    t.prefill([1, 2, 3])
    with pytest.raises(TargetError, match="3 tokens for 1 nodes"):
        t.forward_tree([1, 2, 3], [-1])
    t.forward_tree([4, 5, 6], [-1, -1])
    assert [layer.self_attn for layer in model.model.layers] == before
    assert type(model.model.layers[0].self_attn).__name__ == "Attention"


def test_keep_path_refuses_a_path_without_a_tree_forward():
    t = KVTarget(MODELS["llama"])
    t.prefill([1, 2, 3])
    with pytest.raises(TargetError, match="keep_path"):
        t.keep_path([0])


def test_recurrent_and_unknown_targets_say_why_they_verify_chains_only():
    recurrent = make_target(tiny_hybrid("qwen3_5"))
    assert recurrent.tree_unsupported == "recurrent state"
    with pytest.raises(TargetError, match="chains only: recurrent state"):
        recurrent.forward_tree([1, 2], [-1])
    assert all(make_target(m).tree_unsupported == "" for m in MODELS.values())
    mx.eval(recurrent.forward([1]).logits)
