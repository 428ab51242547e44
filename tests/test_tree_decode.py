"""Tier 2: the decode loop over draft trees: greedy output equals AR for any tree, sampling
keeps the target's distribution, and chain-only targets get each tree's best chain."""

import numpy as np
from distribution import assert_same, exact_sequences
from drafters_for_tests import ListDrafter, TreeDrafter
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import prompts, tree_program
from tiny import VOCAB, ar_greedy, tiny_model
from tiny_recurrent import tiny_hybrid

from adaspec.drafters.base import Draft, DraftContext
from adaspec.loop import sampling
from adaspec.loop.controller import DecodeConfig, Decoder, decode
from adaspec.targets import make_target
from adaspec.targets.kv import KVTarget


@settings(max_examples=25)
@given(
    prompt=prompts(VOCAB),
    max_tokens=st.integers(1, 24),
    program=tree_program,
    nodes=st.integers(1, 16),
)
def test_greedy_output_equals_ar_for_any_tree(tiny, prompt, max_tokens, program, nodes):
    ref = ar_greedy(tiny, prompt, max_tokens)
    drafter = TreeDrafter(program, ref, len(prompt), VOCAB)
    dec = Decoder(KVTarget(tiny), drafter, DecodeConfig(max_tokens=max_tokens, tree_nodes=nodes))
    out = [e.token for e in decode(dec, prompt)]
    assert out == ref
    assert dec.target.offset == len(prompt) + len(out) - 1
    assert drafter.tokens == prompt + out == dec.committed


def test_oracle_trees_are_accepted_along_their_true_branch(tiny):
    prompt, n = [5, 6, 7], 20
    ref = ar_greedy(tiny, prompt, n)
    drafter = TreeDrafter([("oracle", 12, s) for s in range(50)], ref, len(prompt), VOCAB)
    dec = Decoder(KVTarget(tiny), drafter, DecodeConfig(max_tokens=n, tree_nodes=12))
    assert [e.token for e in decode(dec, prompt)] == ref
    s = dec.stats
    assert s.tree_steps > 0 and s.chains_only == ""
    assert s.accepted == sum(drafter.branches)  # every hidden branch accepted to its end


class WideTree(ListDrafter):
    """Ignores the node budget: always the same tree [a, b] under the root, c under a."""

    def draft(self, ctx: DraftContext) -> Draft:
        return Draft((3, 4, 5), parents=(-1, -1, 0)) if ctx.max_draft >= 2 else Draft()


def test_a_chain_only_target_gets_the_best_chain_with_the_reason_counted():
    model = tiny_hybrid("qwen3_5")
    prompt, n = [1, 2, 3], 6
    want = [e.token for e in decode(Decoder(make_target(model), None, DecodeConfig(n)), prompt)]
    dec = Decoder(make_target(model), WideTree(), DecodeConfig(max_tokens=n, tree_nodes=8))
    assert [e.token for e in decode(dec, prompt)] == want
    assert dec.stats.chains_only == "recurrent state"
    assert dec.stats.chained["recurrent state"] == dec.stats.spec_steps > 0
    assert dec.stats.tree_steps == 0


V = 8
PROMPT = [1, 2, 3]
MODEL = tiny_model("llama", vocab=V, seed=3, scale=0.5)


class FixedTree(ListDrafter):
    """A deterministic tree: three candidates for the next token, two after the first."""

    def draft(self, ctx: DraftContext) -> Draft:
        if ctx.max_draft < 2:
            return Draft()
        return Draft((4, 2, 6, 4, 1), parents=(-1, -1, -1, 0, 0))


class SampledTree(ListDrafter):
    """Three i.i.d. draws from q0 for the next token, one draw from q1 under each."""

    Q = np.random.default_rng(5).dirichlet(np.ones(V), size=2)

    def draft(self, ctx: DraftContext) -> Draft:
        if ctx.max_draft < 2:
            return Draft()
        q0, q1 = self.Q
        toks = [int(ctx.rng.choice(V, p=q0)) for _ in range(3)]
        toks += [int(ctx.rng.choice(V, p=q1)) for _ in range(3)]
        return Draft(tuple(toks), np.stack([q0] * 3 + [q1] * 3), parents=(-1, -1, -1, 0, 1, 2))


def test_tree_sampling_matches_the_targets_joint_distribution():
    params = sampling.SamplingParams(temp=0.8)
    want = exact_sequences(MODEL, PROMPT, V, 2, params)
    for make in (FixedTree, SampledTree):
        counts = np.zeros(V * V)
        for s in range(1500):
            dec = Decoder(
                KVTarget(MODEL),
                make(),
                DecodeConfig(max_tokens=3, sampling=params, tree_nodes=8),
                rng=np.random.default_rng(s),
            )
            a, b = [e.token for e in decode(dec, PROMPT)][:2]
            counts[a * V + b] += 1
        assert dec.stats.tree_steps >= 1
        assert_same(counts, want)
