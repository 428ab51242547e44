"""adaspec.testing.check_drafter: the built-in drafters pass it, and it catches each kind of
broken drafter (no rollback, a view gone past EOS, a sampled draft without q or with a wrong q,
never accepted)."""

import numpy as np
import pytest

from adaspec.drafters.base import Draft
from adaspec.testing import DrafterContractError, check_drafter
from adaspec.testing.target import TINY_VOCAB, next_char_id


class Follower:
    """Drafts the chain of what followed each token last time in its view (a correct drafter)."""

    name = "follower"
    needs_taps: tuple[int, ...] = ()
    vocab_size = None

    def __init__(self):
        self.tokens: list[int] = []

    def prefill(self, prompt_tokens, ctx):
        self.tokens = list(prompt_tokens)

    def advance(self, committed_tokens, ctx):
        self.tokens += list(committed_tokens)

    def rollback(self, n):
        del self.tokens[len(self.tokens) - n :]

    def follows(self) -> dict[int, int]:
        return {a: b for a, b in zip(self.tokens, self.tokens[1:])}

    def draft(self, ctx):
        nxt, out, last = self.follows(), [], self.tokens[-1]
        while len(out) < ctx.max_draft and last in nxt:
            last = nxt[last]
            out.append(last)
        return Draft(tuple(out))


class NoRollback(Follower):
    def rollback(self, n):
        pass  # the bug: the view keeps tokens the consumer never received


class PastEos(Follower):
    """Keeps its whole draft in its view when the commit ended inside it (EOS cut the step):
    its view then runs past EOS into tokens that were never committed."""

    def draft(self, ctx):
        self.last = super().draft(ctx).tokens
        return Draft(self.last)

    def advance(self, committed_tokens, ctx):
        c, d = list(committed_tokens), list(getattr(self, "last", ()))
        self.tokens += d if c and len(c) < len(d) and d[: len(c)] == c else c
        self.last = ()


class Sampler(Follower):
    """At T>0 drafts the cycle's next token (q = 0.8) or a neighbour (q = 0.2)."""

    vocab_size = TINY_VOCAB

    def q_row(self, last):
        row = np.zeros(TINY_VOCAB)
        row[next_char_id(last) if last < TINY_VOCAB - 1 else 0] += 0.8
        row[(last + 5) % (TINY_VOCAB - 1)] += 0.2
        return row

    def draft(self, ctx):
        if ctx.temperature == 0:
            return super().draft(ctx)
        rows, toks, last = [], [], self.tokens[-1]
        for _ in range(min(2, ctx.max_draft)):
            rows.append(self.q_row(last))
            last = int(ctx.rng.choice(TINY_VOCAB, p=rows[-1]))
            toks.append(last)
        return self.result(toks, np.array(rows))

    def result(self, toks, rows):
        return Draft(tuple(toks), rows)


class OmitsQ(Sampler):
    def result(self, toks, rows):
        return Draft(tuple(toks))


class WrongQ(Sampler):
    def result(self, toks, rows):
        return Draft(tuple(toks), np.where(rows > 0, 1.0 - rows, 0.0))  # 0.8 and 0.2 swapped


class NeverAccepted(Follower):
    def draft(self, ctx):
        return Draft((TINY_VOCAB - 1,) * min(3, ctx.max_draft))  # <eos>: never the greedy pick


def test_a_correct_drafter_passes_and_the_report_counts_accepted_drafts():
    report = check_drafter(Follower, examples=8, runs=400)
    assert report.accepted > 0 and report.sampled_accepted > 0 and report.state_checks > 100
    assert report.pvalue is not None and "accepted" in str(report)


def test_a_sampling_drafter_with_the_right_q_passes():
    report = check_drafter(Sampler, examples=4, runs=600)
    assert report.sampled_accepted > 0


@pytest.mark.parametrize(
    "broken, message",
    [
        (NoRollback, "does not follow prefill, advance and rollback"),
        (PastEos, "does not follow prefill, advance and rollback"),
        (OmitsQ, "a sampled draft must carry q"),
        (WrongQ, "does not follow the target's distribution"),
        (NeverAccepted, "none accepted"),
    ],
)
def test_a_broken_drafter_fails_naming_what_broke(broken, message):
    with pytest.raises(DrafterContractError, match=message):
        check_drafter(broken, examples=8, runs=1500)


@pytest.mark.parametrize("spec", ["pld", "suffix", "pld:min_ngram=2"])
def test_built_in_drafters_pass(spec):
    report = check_drafter(lambda: spec, examples=6, runs=400)
    assert report.accepted > 0


def test_the_draft_model_drafter_passes_on_a_copy_of_the_target(tmp_path):
    from adaspec.testing import save_tiny, tiny_target, tiny_tokenizer

    folder = save_tiny(tiny_target(), tiny_tokenizer(), tmp_path / "tiny")
    report = check_drafter(lambda: f"draft-model:{folder}", examples=4, runs=300)
    # the target drafting for itself: every sampled draft accepted (greedy drafts past an EOS
    # or an early stop are not counted as accepted)
    assert report.sampled_accepted == report.sampled_drafted > 0
    assert report.accepted > report.drafted / 2


def test_a_dflash_drafter_on_the_tiny_target_passes():
    """Random DFlash weights over the tiny target's features: accepted by chance only, but its
    context must follow every commit and rollback as a fresh prefill's does."""
    from tiny_dflash import tiny_drafter

    from adaspec.testing import tiny_target

    report = check_drafter(lambda: tiny_drafter(tiny_target(), block=4), examples=2, runs=100)
    assert report.state_checks > 100 and report.accepted > 0
