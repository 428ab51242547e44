"""Tier 2: random forward/accept/rollback programs on real mlx-lm caches vs a list model."""

import mlx.core as mx
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from strategies import token_trees
from tiny import VOCAB, tiny_model

from adaspec.targets import make_target
from adaspec.targets.kv import KVTarget

MODELS = {"llama": tiny_model("llama"), "qwen3": tiny_model("qwen3")}


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        arch=st.sampled_from(sorted(MODELS)),
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    )
    def start(self, arch, prompt):
        self.model, self.arch = MODELS[arch], arch
        self.target = KVTarget(self.model, prefill_step=7)
        self.target.prefill(prompt)
        self.cached = list(prompt)  # the list model: tokens in the cache

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), data=st.data())
    def verify_then_accept(self, tokens, data):
        self.target.forward(tokens)
        keep = data.draw(st.integers(0, len(tokens)), label="keep")
        self.target.rollback(len(tokens) - keep)
        self.cached += tokens[:keep]

    @rule(
        root=st.integers(0, VOCAB - 1),
        tree=token_trees(VOCAB, max_nodes=10, min_nodes=1),
        data=st.data(),
    )
    def verify_tree_then_keep_a_path(self, root, tree, data):
        if self.target.tree_unsupported:  # a chain-only target is tested by the other rules
            return
        tokens, parents = tree
        self.target.forward_tree([root, *tokens], parents)
        path, cur = [], -1
        while kids := [i for i, p in enumerate(parents) if p == cur]:
            if not data.draw(st.booleans(), label="deeper"):
                break
            cur = data.draw(st.sampled_from(kids), label="child")
            path.append(cur)
        self.target.keep_path(path)
        self.cached += [root, *(tokens[i] for i in path)]

    @rule(data=st.data())
    def rollback_committed(self, data):
        n = data.draw(st.integers(0, len(self.cached) - 1), label="n")
        self.target.rollback(n)
        del self.cached[len(self.cached) - n :]

    @invariant()
    def offset_is_cached_length(self):
        if hasattr(self, "target"):
            assert self.target.offset == len(self.cached)

    @invariant()
    def logits_match_a_never_speculated_cache(self):
        if not hasattr(self, "target"):
            return
        probe = [7, 3]
        got = self.target.forward(probe).logits
        self.target.rollback(len(probe))
        fresh = make_target(self.model)  # the adapter a never-speculated generation would use
        fresh.prefill(self.cached)
        want = fresh.forward(probe).logits
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)


CacheMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=8, deadline=None)
TestCache = CacheMachine.TestCase


def test_tap_features_are_layer_outputs_and_layers_restored():
    model = MODELS["llama"]
    t = KVTarget(model)
    layers_before = list(model.model.layers)
    feats = t.prefill([1, 2, 3, 4], taps=(0, 1))
    assert feats.shape == (4, 2 * 64)
    assert list(model.model.layers) == layers_before  # wrappers removed
    # layer 1's output is the input of the final norm: recompute the logits from it
    out = t.forward([5], taps=(1,))
    h = out.features
    logits = model.model.embed_tokens.as_linear(model.model.norm(h))
    np.testing.assert_allclose(np.array(logits), np.array(out.logits), atol=1e-4)
    mx.eval(feats)
