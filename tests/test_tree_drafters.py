"""Trees from the drafters (PLD branches, DFlash best-first) and the policy's node budget."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import prompts
from tiny import VOCAB, ar_greedy, byte_tokenizer, tiny_model
from tiny_dflash import tiny_drafter

from adaspec.drafters.base import Draft, DraftContext
from adaspec.drafters.dflash import best_first
from adaspec.drafters.draft_model import DraftLM
from adaspec.drafters.pld import PromptLookup
from adaspec.loop.controller import DecodeConfig, Decoder, decode
from adaspec.policy import tree_size
from adaspec.settings import from_env
from adaspec.targets.base import target_info
from adaspec.targets.kv import KVTarget


def test_pld_offers_the_distinct_continuations_of_its_matches_latest_first():
    p = PromptLookup(2, 1, 3)
    seq = [1, 2, 7, 8, 9, 1, 2, 5, 6, 0, 1, 2, 7, 8, 4, 1, 2]
    p.prefill(seq, DraftContext(seq, 0))
    chain = p.draft(DraftContext(p.tokens, 3))
    tree = p.draft(DraftContext(p.tokens, 3, tree_nodes=8))
    assert chain.tokens == (7, 8, 4) and not chain.is_tree
    # latest match 7 8 4, then 5 6 0, then 7 8 9 shares 7 8 with the first
    assert tree.tokens == (7, 8, 4, 5, 6, 0, 9) and tree.parents == (-1, 0, 1, -1, 3, 4, 1)
    assert tree.best_chain().tokens == chain.tokens
    small = p.draft(DraftContext(p.tokens, 3, tree_nodes=4))
    assert len(small) == 4 and small.tokens[:3] == chain.tokens


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.integers(1, 6), st.integers(0, 12))
def test_pld_trees_are_legal_and_within_budget(tokens, k, nodes):
    p = PromptLookup(3, 1, 10)
    p.prefill(tokens, DraftContext(tokens, 0))
    d = p.draft(DraftContext(tokens, k, tree_nodes=nodes))
    assert max(d.depths(), default=0) <= k and (not d.is_tree or len(d) <= nodes)


def test_best_first_takes_the_most_probable_nodes_first_child_the_likeliest():
    ids = np.array([[5, 6], [7, 8], [9, 1]])
    lp = np.log(np.array([[0.6, 0.3], [0.9, 0.05], [0.5, 0.4]]))
    tokens, _, parents = best_first(ids, lp, 4)
    # 5 (.6), 5-7 (.54), 6 (.3), 5-7-9 (.27)
    assert tokens == (5, 7, 6, 9) and parents == (-1, 0, -1, 1)
    assert Draft(tokens, parents=parents).best_chain().tokens == (5, 7, 9)


@settings(max_examples=10)
@given(prompt=prompts(12, max_len=12), n=st.integers(1, 20), seed=st.integers(0, 99))
def test_dflash_trees_keep_greedy_output_equal_to_ar(prompt, n, seed):
    target = tiny_model("qwen3", vocab=12, seed=2)
    drafter = tiny_drafter(target, seed=seed)
    dec = Decoder(KVTarget(target), drafter, DecodeConfig(max_tokens=n, tree_nodes=8))
    assert [e.token for e in decode(dec, prompt)] == ar_greedy(target, prompt, n)
    assert drafter.tokens == dec.committed
    assert drafter.cache.length == len(dec.committed) - 1
    assert dec.stats.tree_steps > 0 or dec.stats.spec_steps == 0


def test_tree_nodes_setting():
    assert from_env({}).tree_nodes == "0" and from_env({}).tree_cap == 0  # chains by default
    assert from_env({"ADASPEC_TREE_NODES": "auto"}).tree_cap == 16
    assert from_env({"ADASPEC_TREE_NODES": "0"}).tree_cap == 0
    assert from_env({"ADASPEC_TREE_NODES": "12"}).tree_cap == 12


def test_auto_tries_every_budget_then_keeps_the_fastest_and_retries_the_runner_up():
    cfg = tree_size.TreeSizeConfig(cap=16, auto=True, tries=2, explore=5)
    assert cfg.budgets() == (0, 8, 16)
    s, rate = tree_size.TreeSizeState(), {0: 10.0, 8: 30.0, 16: 20.0}
    picked = []
    for _ in range(20):
        b = tree_size.choose(cfg, s)
        picked.append(b)
        s = tree_size.observe(cfg, s, b, int(rate[b]), 1.0)
    assert picked[:6] == [0, 0, 8, 8, 16, 16]
    assert picked[6:11] == [8] * 5 and picked[11] == 16  # the runner-up, tried again
    fixed = tree_size.TreeSizeConfig(cap=12)
    assert tree_size.choose(fixed, tree_size.TreeSizeState()) == 12
    assert tree_size.TreeSizeConfig(cap=0, auto=True).budgets() == (0,)


@settings(max_examples=10)
@given(prompt=prompts(VOCAB), n=st.integers(1, 20), k=st.integers(1, 6), nodes=st.integers(2, 12))
def test_draft_model_trees_keep_greedy_output_equal_to_ar(prompt, n, k, nodes):
    target, tok = tiny_model("llama"), byte_tokenizer()
    lm = DraftLM(tiny_model("llama", seed=7, layers=1), tok, target_info(target, tok))
    dec = Decoder(
        KVTarget(target, tok), lm, DecodeConfig(max_tokens=n, max_draft=k, tree_nodes=nodes)
    )
    assert [e.token for e in decode(dec, prompt)] == ar_greedy(target, prompt, n)
    assert lm.tokens == dec.committed
    assert dec.stats.tree_steps > 0 or nodes <= k or dec.stats.spec_steps == 0


def test_draft_model_tree_is_the_chain_plus_likeliest_leaves():
    target, tok = tiny_model("llama"), byte_tokenizer()
    lm = DraftLM(tiny_model("llama", seed=7, layers=1), tok, target_info(target, tok))
    prompt = [65, 66, 67]
    lm.prefill(prompt, DraftContext(prompt, 0))
    chain = lm.draft(DraftContext(prompt, 3))
    lm.rollback(0)
    tree = lm.draft(DraftContext(prompt, 3, tree_nodes=6))
    assert len(tree) == 6 and tree.best_chain().tokens == chain.tokens
    assert all(p < 3 for p in tree.parents[3:])  # leaves hang off the chain
