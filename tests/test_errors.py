"""Bad input gets a clear error naming the value and what is accepted; nothing unverified
is emitted."""

import pytest
from drafters_for_tests import ListDrafter
from tiny import VOCAB

import adaspec
from adaspec.drafters.base import Draft
from adaspec.errors import (
    DrafterError,
    DrafterMismatchError,
    GenerationArgumentError,
    SettingsError,
)
from adaspec.settings import from_env


def gen(model, tok, prompt="hello", **kw):
    return list(adaspec.stream_generate(model, tok, prompt, **kw))


class Bad(ListDrafter):
    def __init__(self, tokens, vocab_size=None):
        super().__init__()
        self.bad, self.vocab_size = tokens, vocab_size

    def draft(self, ctx):
        return Draft(self.bad)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(tiny, tokenizer, prompt):
    with pytest.raises(GenerationArgumentError, match="prompt"):
        gen(tiny, tokenizer, prompt)


@pytest.mark.parametrize("n", [0, -1, 2.5])
def test_bad_max_tokens(tiny, tokenizer, n):
    with pytest.raises(GenerationArgumentError, match=f"max_tokens={n}.*accepted: >= 1"):
        gen(tiny, tokenizer, max_tokens=n)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"temp": -1}, "temp=-1"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": VOCAB}, f"top_k={VOCAB}"),
        ({"min_p": 2}, "min_p=2"),
        ({"stop": "x"}, "stop='x'"),
    ],
)
def test_bad_sampling_args(tiny, tokenizer, kw, match):
    with pytest.raises(GenerationArgumentError, match=match):
        gen(tiny, tokenizer, **kw)


def test_unknown_drafter_lists_known_ones(tiny, tokenizer):
    with pytest.raises(DrafterError, match="unknown drafter 'nope'; accepted: none, .*pld"):
        gen(tiny, tokenizer, drafter="nope")


def test_vocabulary_mismatch(tiny, tokenizer):
    with pytest.raises(DrafterMismatchError, match=f"vocabulary size 99.*target has {VOCAB}"):
        gen(tiny, tokenizer, drafter=Bad((1,), vocab_size=99))


@pytest.mark.parametrize(
    "tokens, match",
    [
        ((1, VOCAB + 3), "outside the target's vocabulary"),
        ((1,) * 100, "proposed 100 tokens; at most 16 allowed"),
    ],
)
def test_illegal_drafts_are_refused_before_anything_is_emitted(tiny, tokenizer, tokens, match):
    # gates off: the drafter is consulted at the very first step
    settings = from_env({}, gate="off")
    stream = adaspec.stream_generate(
        tiny, tokenizer, "hello", drafter=Bad(tokens), max_tokens=20, settings=settings
    )
    with pytest.raises(DrafterError, match=match):
        next(stream)


@pytest.mark.parametrize(
    "env, match",
    [
        ({"ADASPEC_PLD_MAX_NGRAM": "abc"}, "ADASPEC_PLD_MAX_NGRAM='abc' is invalid"),
        ({"ADASPEC_PLD_DRAFT_LEN": "0"}, "ADASPEC_PLD_DRAFT_LEN='0' is invalid"),
        ({"ADASPEC_BLAS": "fast"}, "accepted: auto, routed, mkl, openblas, off"),
        ({"ADASPEC_NOPE": "1"}, "unknown environment variable ADASPEC_NOPE"),
        ({"ADASPEC_PLD_MIN_NGRAM": "4", "ADASPEC_PLD_MAX_NGRAM": "2"}, "MIN_NGRAM=4 is larger"),
    ],
)
def test_bad_environment_values(env, match):
    with pytest.raises(SettingsError, match=match):
        from_env(env)
