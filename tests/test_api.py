"""Tier 2: the public API against mlx-lm's own stream_generate, stop strings, registry."""

import importlib.util
from pathlib import Path

import mlx_lm
import pytest
from tiny import tiny_model

import adaspec
from adaspec.drafters import registry

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "the cat sat on the mat; the cat sat on the mat; the cat"


@pytest.mark.parametrize("drafter", [None, "pld"])
def test_responses_match_mlx_lm_stream_generate(tiny, tokenizer, drafter):
    ours = list(adaspec.stream_generate(tiny, tokenizer, PROMPT, max_tokens=40, drafter=drafter))
    ref = list(mlx_lm.stream_generate(tiny, tokenizer, PROMPT, max_tokens=40))
    assert [r.token for r in ours] == [r.token for r in ref]
    assert [r.text for r in ours] == [r.text for r in ref]
    assert ours[-1].finish_reason == ref[-1].finish_reason == "length"
    assert ours[-1].generation_tokens == ref[-1].generation_tokens == 40
    assert sum(r.step is not None for r in ours) == ours[-1].stats.steps


def test_eos_token_ends_like_mlx_lm(tokenizer):
    model = tiny_model("llama")
    plain = list(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=30))
    eos = plain[7].token
    tokenizer.eos_token_ids = {eos}
    try:
        ref = list(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=30))
        ours = list(adaspec.stream_generate(model, tokenizer, PROMPT, max_tokens=30, drafter="pld"))
    finally:
        tokenizer.eos_token_ids = {256}
    assert [(r.token, r.text) for r in ours] == [(r.token, r.text) for r in ref]
    assert ours[-1].finish_reason == "stop" and ours[-1].token == eos


def test_stop_string_cuts_text_where_it_first_appears(tiny, tokenizer):
    full = adaspec.generate(tiny, tokenizer, PROMPT, max_tokens=40)
    stop = full[12:15]
    want = full[: full.index(stop)]
    rs = list(
        adaspec.stream_generate(tiny, tokenizer, PROMPT, max_tokens=40, drafter="pld", stop=[stop])
    )
    assert "".join(r.text for r in rs) == want
    assert rs[-1].finish_reason == "stop"


def test_custom_drafter_from_the_docs_runs_and_is_lossless(tiny, tokenizer):
    path = ROOT / "docs" / "examples" / "last_token_drafter.py"
    spec = importlib.util.spec_from_file_location("last_token_drafter", path)
    module = importlib.util.module_from_spec(spec)
    registry._FACTORIES.pop("last-follower", None)
    spec.loader.exec_module(module)
    assert len(path.read_text().splitlines()) <= 40
    assert path.read_text().strip() in (ROOT / "docs" / "drafters.md").read_text()
    ref = mlx_lm.generate(tiny, tokenizer, PROMPT, max_tokens=30)
    for spec in ("last-follower:max_len=3", "pld+last-follower"):
        rs = list(adaspec.stream_generate(tiny, tokenizer, PROMPT, max_tokens=30, drafter=spec))
        assert "".join(r.text for r in rs) == ref and rs[-1].stats.drafted > 0
    assert rs[-1].stats.arm_names == ["pld", "last-follower"]


def test_entry_point_drafters_are_discovered(monkeypatch, tiny, tokenizer):
    class EP:
        name, value = "ep-pld", "adaspec.drafters.pld:ENTRY"

    monkeypatch.setattr(registry, "entry_points", lambda group: [EP()])
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    assert "ep-pld" in registry.names()
    text = adaspec.generate(tiny, tokenizer, PROMPT, max_tokens=10, drafter="ep-pld:draft_len=3")
    assert text == mlx_lm.generate(tiny, tokenizer, PROMPT, max_tokens=10)


def test_compare_to_ar_reports_identical_tokens_and_rates():
    from adaspec.testing import encode, tiny_target, tiny_tokenizer

    model, tok = tiny_target(), tiny_tokenizer()
    c = adaspec.compare_to_ar(model, tok, encode("the the t"), drafter="pld", max_tokens=24)
    assert c.identical and c.tokens == c.ar_tokens and len(c.tokens) == 24
    assert c.ar_tok_s > 0 and c.spec_tok_s > 0 and c.speedup == c.spec_tok_s / c.ar_tok_s
    assert c.stats["accepted"] > 0 and "identical: True" in str(c)
    sampled = adaspec.compare_to_ar(model, tok, encode("the q"), drafter="pld", temp=1.0, seed=3)
    assert len(sampled.tokens) > 0 and len(sampled.ar_tokens) > 0
    assert 0 <= sampled.stats["accepted"] <= sampled.stats["drafted"]
    assert sampled.speedup == sampled.spec_tok_s / sampled.ar_tok_s


def test_a_new_generation_starts_from_what_the_last_one_on_the_model_measured(tokenizer):
    """Without a prompt cache, the second generation with the same drafter and settings starts
    from the first one's plain-step time (no burst of plain steps to time decoding); another
    drafter spec or other settings start afresh; the tokens are the same either way."""
    from adaspec.policy import latest
    from adaspec.settings import from_env

    model = tiny_model("llama", seed=11)
    ar = adaspec.generate(model, tokenizer, PROMPT, max_tokens=30)

    def stats(model, drafter, settings=None):
        rs = list(
            adaspec.stream_generate(
                model, tokenizer, PROMPT, max_tokens=30, drafter=drafter, settings=settings
            )
        )
        assert "".join(r.text for r in rs) == ar
        return rs[-1].stats

    assert stats(model, "pld").measure_steps == 4
    assert stats(model, "pld").measure_steps == 0
    assert stats(model, "pld:min_ngram=2").measure_steps == 4  # another spec: its own
    other = from_env({"ADASPEC_DRAFT_MAX": "8"})
    assert stats(model, "pld", other).measure_steps == 4  # other settings: their own
    assert stats(model, "pld", other).measure_steps == 0
    assert id(model) in latest._LATEST
    key = id(model)
    del model
    import gc

    gc.collect()
    assert key not in latest._LATEST  # forgotten with the model
