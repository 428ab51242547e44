"""A drafter spec becomes one DrafterPlan at the boundary: parsed, `auto` expanded from the
target's shipped drafters, every arm's arguments checked before any drafter is built; the
plan is what the CLI, the Python API and serve's requests hand on."""

import pytest
from tiny import byte_tokenizer, tiny_model

import adaspec
from adaspec import settings as settings_mod
from adaspec.drafters import registry
from adaspec.drafters.arms import DrafterPlan, check, plan
from adaspec.errors import DrafterError
from adaspec.targets.base import target_info

MODEL, TOK = tiny_model("llama"), byte_tokenizer()
INFO = target_info(MODEL, TOK)
S = settings_mod.from_env({})


def test_auto_is_expanded_into_typed_arms():
    p = plan("auto", INFO, S)
    assert str(p) == "auto" and p.names() == ("pld", "suffix", "pld")
    assert p.expanded() == "pld:min_ngram=2+suffix:context=false+pld:min_ngram=1"
    assert [a.args.options for a in p.arms] == [
        {"min_ngram": 2},
        {"context": False},
        {"min_ngram": 1},
    ]
    assert plan("auto:min_match=1,suffix=false", INFO, S).expanded() == "pld"
    d = plan("auto:draft-model:somewhere,min_p1=0.5", INFO, S).find("draft-model")
    assert d is not None and d.args.path == "somewhere" and d.args.options == {"min_p1": 0.5}
    assert plan("none", INFO, S).arms == () and plan("none", INFO, S).expanded() == "none"


def test_every_arm_is_checked_before_any_is_built():
    built = []
    registry.register("counting", lambda args, info, s: built.append(1), path=None, replace=True)
    with pytest.raises(DrafterError, match="pld argument max_ngram='x' is not an integer"):
        plan("counting+pld:max_ngram=x", INFO, S)
    assert built == []  # before: the first arm was built, then the second refused


def test_a_plan_passes_through_and_generates_like_its_spec():
    p = plan("pld+suffix", INFO, S)
    assert plan(p, INFO, S) is p and isinstance(p, DrafterPlan)
    prompt = "the cat sat on the mat. the cat sat on the"
    want = adaspec.generate(MODEL, TOK, prompt, max_tokens=20, drafter="pld+suffix")
    assert adaspec.generate(MODEL, TOK, prompt, max_tokens=20, drafter=p) == want
    rs = list(adaspec.stream_generate(MODEL, TOK, prompt, max_tokens=20, drafter=p))
    assert rs[-1].stats.arm_names == ["pld", "suffix"]


@pytest.mark.parametrize(
    "spec, match",
    [
        ("pld+nope", "unknown drafter 'nope'"),
        ("auto:pld", "PLD and suffix lookup already come first"),
        ("auto:dflash,suffix=maybe", "suffix='maybe' is invalid"),
        ("pld+none", "'none' cannot be an arm"),
        ("pld:max_ngram=x", "is not an integer"),
    ],
)
def test_check_refuses_without_a_model(spec, match):
    with pytest.raises(DrafterError, match=match):
        check(spec)


def test_check_accepts_what_a_target_may_expand():
    for spec in ("none", "auto", "auto:draft-model:m,min_p1=0.5", "pld+suffix", "auto:DIR"):
        check(spec)
