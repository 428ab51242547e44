"""PLD: the incremental index drafts exactly what a naive rescan would, through any
append/rollback program; knobs are validated."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from adaspec.drafters.arms import make
from adaspec.drafters.base import DraftContext
from adaspec.drafters.pld import PromptLookup
from adaspec.errors import DrafterError
from adaspec.settings import Settings

tok = st.integers(0, 4)  # a tiny alphabet makes repeats (and matches) common


def naive(tokens, max_n, min_n, k):
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        suffix = tokens[L - n :]
        for i in range(L - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[i : i + n] == suffix:
                return tuple(tokens[i + n : i + n + k])
    return ()


class PLDMachine(RuleBasedStateMachine):
    @initialize(
        prompt=st.lists(tok, min_size=1, max_size=30),
        max_n=st.integers(1, 4),
        min_n=st.integers(1, 4),
        k=st.integers(1, 8),
    )
    def start(self, prompt, max_n, min_n, k):
        min_n = min(min_n, max_n)
        self.args = (max_n, min_n, k)
        self.pld = PromptLookup(max_n, min_n, k)
        self.pld.prefill(prompt, DraftContext(prompt, 0))
        self.model = list(prompt)

    @rule(tokens=st.lists(tok, min_size=1, max_size=6))
    def advance(self, tokens):
        self.pld.advance(tokens, DraftContext(self.model, 0))
        self.model += tokens

    @rule(data=st.data())
    def rollback(self, data):
        n = data.draw(st.integers(0, len(self.model) - 1))
        self.pld.rollback(n)
        del self.model[len(self.model) - n :]

    @invariant()
    def drafts_like_a_rescan(self):
        if hasattr(self, "pld"):
            got = self.pld.draft(DraftContext(self.model, 99)).tokens
            assert got == naive(self.model, *self.args)
            assert self.pld.tokens == self.model


PLDMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=15)
TestPLD = PLDMachine.TestCase


@given(st.lists(tok, min_size=1, max_size=40), st.integers(0, 9))
def test_draft_respects_budget_and_is_deterministic(tokens, budget):
    a, b = PromptLookup(3, 1, 10), PromptLookup(3, 1, 10)
    for p in (a, b):
        p.prefill(tokens, DraftContext(tokens, 0))
    da, db = a.draft(DraftContext(tokens, budget)), b.draft(DraftContext(tokens, budget))
    assert da == db and len(da) <= budget


def test_bad_knobs_are_rejected_with_names():
    with pytest.raises(DrafterError, match="min=3, max=2"):
        PromptLookup(2, 3, 4)
    with pytest.raises(DrafterError, match="draft_len"):
        PromptLookup(2, 1, 0)
    with pytest.raises(DrafterError, match="accepted: max_ngram"):
        make("pld:bogus=1", None, Settings())
    with pytest.raises(DrafterError, match="max_ngram='x' is not an integer"):
        make("pld:max_ngram=x", None, Settings())
    assert make("pld:max_ngram=5,draft_len=4", None, Settings()).max_ngram == 5


def test_strong_only_when_the_match_runs_far_back():
    p = PromptLookup(3, 1, 4, strong_match=6)
    copied = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    p.prefill(copied + [0] + copied[:6], DraftContext([], 0))  # suffix matches 6 tokens back
    d = p.draft(DraftContext(p.tokens, 10))
    assert d.tokens == (3, 2, 1, 0) and d.strong
    q = PromptLookup(3, 1, 4, strong_match=6)
    q.prefill(copied + [0] + [5, 4, 3], DraftContext([], 0))  # only the 3-gram matches
    d = q.draft(DraftContext(q.tokens, 10))
    assert d.tokens == (2, 1, 0, 5) and not d.strong
