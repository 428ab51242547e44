"""Tier 2: the replay adapter on tiny qwen3_next, qwen3_5 and mamba2 models: random
verify/accept/rollback programs vs a never-speculated cache, the strategies against each
other, taps, and refusals that name the layer and cache type."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from test_target_stateful import CacheMachine
from tiny import VOCAB, tiny_model
from tiny_recurrent import HYBRIDS, OTHER_CONFIGS, tiny_hybrid, tiny_other

from adaspec.errors import TargetError
from adaspec.targets import make_target
from adaspec.targets.architectures import available
from adaspec.targets.base import layer_list
from adaspec.targets.kv import KVTarget
from adaspec.targets.replay import ReplayTarget

MODELS = {arch: tiny_hybrid(arch) for arch in (*HYBRIDS, "qwen3_5_moe")}
PLANS = [(arch, s) for arch in HYBRIDS for s in available(ReplayTarget(MODELS[arch]))]
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10)


def fresh_logits(model, cached, probe):
    t = ReplayTarget(model, strategy="refeed")
    t.prefill(cached)
    return np.array(t.forward(probe).logits)


class ReplayMachine(CacheMachine):
    """The KV machine's rules and invariants (forward/accept, rollback of committed tokens,
    logits vs a never-speculated cache) on recurrent targets, one per (arch, strategy)."""

    @initialize(
        plan=st.sampled_from(PLANS),
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16),
    )
    def start(self, plan, prompt):
        arch, strategy = plan
        self.model = MODELS[arch]
        self.target = ReplayTarget(self.model, strategy=strategy, prefill_step=5)
        self.target.prefill(prompt)
        self.cached = list(prompt)

    @rule(toks=tokens, data=st.data())
    def verify_then_accept_in_two_rollbacks(self, toks, data):
        # the controller's step rollback, then an early stop's unwind into the same forward
        self.target.forward(mx.array(toks))
        first = data.draw(st.integers(0, len(toks)), label="first")
        second = data.draw(st.integers(0, len(toks) - first), label="second")
        self.target.rollback(first)
        self.target.rollback(second)
        self.cached += toks[: len(toks) - first - second]


ReplayMachine.TestCase.settings = settings(max_examples=24, stateful_step_count=6, deadline=None)
TestReplay = ReplayMachine.TestCase


@pytest.mark.parametrize("arch", sorted(MODELS))
@settings(max_examples=8)
@given(prompt=tokens, steps=st.lists(st.tuples(tokens, st.integers(0, 10)), min_size=1, max_size=5))
def test_strategies_agree(arch, prompt, steps):
    """Every strategy leaves the same recurrent state and the same next logits."""
    model = MODELS[arch]
    targets = [ReplayTarget(model, strategy=s) for s in available(ReplayTarget(model))]
    assert len(targets) == 3
    for t in targets:
        t.prefill(prompt)
    for toks, keep in steps:
        for t in targets:
            t.forward(toks)
            t.rollback(len(toks) - min(keep, len(toks)))
    ref, *others = targets
    want = np.array(ref.forward([5]).logits)
    for t in others:
        np.testing.assert_allclose(np.array(t.forward([5]).logits), want, atol=1e-4, rtol=1e-4)
        for (_, a), (_, b) in zip(ref.recurrent, t.recurrent):
            for x, y in zip(a.cache, b.cache):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-4, rtol=1e-4)


def test_make_target_picks_the_adapter_by_cache_type():
    assert isinstance(make_target(tiny_model("llama")), KVTarget)
    for model in MODELS.values():
        t = make_target(model)
        assert isinstance(t, ReplayTarget) and t.rollback_kind == "replay"
        assert t.strategy.name == available(t)[0]
    assert available(make_target(MODELS["qwen3_5"])) == ("delta", "layers", "refeed")
    assert available(make_target(MODELS["mamba2"])) == ("ssm", "layers", "refeed")


@pytest.mark.parametrize("arch", HYBRIDS)
def test_taps_are_layer_outputs_and_every_wrapper_is_removed(arch):
    model = MODELS[arch]
    layers = layer_list(model)
    before = [(layer, dict(layer)) for layer in layers]
    t = make_target(model)
    feats = t.prefill([1, 2, 3, 4], taps=(0, 3))
    assert feats.shape == (4, 2 * 64)
    out = t.forward([5, 6, 7], taps=(3,))
    t.rollback(2)
    # the last layer's output is the input of the final norm: recompute the logits from it
    inner = model.model if arch != "mamba2" else model.backbone
    norm = inner.norm if arch != "mamba2" else inner.norm_f
    embed = inner.embed_tokens if arch != "mamba2" else inner.embeddings
    logits = embed.as_linear(norm(out.features))
    np.testing.assert_allclose(np.array(logits), np.array(out.logits), atol=1e-4)
    assert [(layer, dict(layer)) for layer in layer_list(model)] == before


def test_deep_rollback_re_prefills_exactly():
    model = MODELS["qwen3_next"]
    t = ReplayTarget(model)
    t.prefill([1, 2, 3, 4, 5, 6])
    t.forward([7, 8])
    t.rollback(5)  # reaches past the last forward into the prompt
    assert t.rebuilds == 1 and t.offset == 3
    np.testing.assert_allclose(
        np.array(t.forward([9]).logits), fresh_logits(model, [1, 2, 3], [9]), atol=1e-4
    )


@pytest.mark.parametrize("arch", sorted(set(OTHER_CONFIGS) - {"recurrent_gemma"}))
def test_other_architectures_roll_back_exactly_with_refeed(arch):
    """lfm2, falcon_h1 (CacheList members), jamba, nemotron_h: the generic strategy."""
    model = tiny_other(arch)
    t = make_target(model)
    assert available(t) == ("refeed",)
    rng = np.random.default_rng(1)
    cached = rng.integers(0, VOCAB, 5).tolist()
    t.prefill(cached)
    for keep in (0, 2, 5, 3):
        toks = rng.integers(0, VOCAB, 5).tolist()
        t.forward(toks)
        t.rollback(5 - keep)
        cached += toks[:keep]
    got = np.array(t.forward([7, 3]).logits)
    np.testing.assert_allclose(got, fresh_logits(model, cached, [7, 3]), atol=1e-4, rtol=1e-4)


def test_wrapped_rotating_cache_is_refused_naming_the_layer():
    """recurrent_gemma's local attention keeps a rotating window of 8 positions: rollback works
    until the window wraps, then it is refused (nothing is changed)."""
    t = make_target(tiny_other("recurrent_gemma"))
    t.prefill([1, 2, 3])
    t.forward([4, 5, 6])
    t.rollback(2)
    t.forward([5, 6, 7, 8, 9, 10])  # 10 positions > 8: the window wraps
    with pytest.raises(TargetError, match=r"cache layer 2 \(RotatingKVCache\).*wrapped"):
        t.rollback(2)
    assert t.offset == 10


def test_quantized_recurrent_state_is_refused_naming_the_layer():
    t = make_target(MODELS["qwen3_5"])
    t.prefill([1, 2, 3])
    state = t.cache[2][1]
    t.cache[2][1] = mx.quantize(state.reshape(-1, 64), group_size=32, bits=4)
    with pytest.raises(TargetError, match=r"cache layer 2 \(ArraysCache\).*quantized"):
        t.forward([4, 5])


def test_unknown_cache_type_is_refused_naming_the_layer():
    class Odd:
        def is_trimmable(self):
            return False

    model = MODELS["mamba2"]
    make = model.make_cache
    model.make_cache = lambda: [*make()[:3], Odd()]
    try:
        with pytest.raises(TargetError, match=r"cache layer 3 is a Odd.*accepted: ArraysCache"):
            make_target(model)
    finally:
        del model.make_cache


def test_cache_list_members_are_rolled_back_with_refeed():
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

    model = MODELS["qwen3_next"]
    make = model.make_cache
    # the shape falcon_h1 uses: (recurrent, attention) members in one layer's CacheList
    model.make_cache = lambda: [
        CacheList(c, KVCache()) if isinstance(c, ArraysCache) else c for c in make()
    ]
    try:
        t = make_target(model)
        assert available(t) == ("refeed",)
        with pytest.raises(TargetError, match="'delta' is not available.*accepted: auto, refeed"):
            ReplayTarget(model, strategy="delta")
    finally:
        del model.make_cache


def test_unsupported_strategy_is_refused():
    with pytest.raises(
        TargetError, match="'delta' is not available for 'mamba2'.*auto, ssm, layers"
    ):
        ReplayTarget(MODELS["mamba2"], strategy="delta")
