"""`adaspec doctor` and `adaspec models` on the command line, and the doctor's report."""

from __future__ import annotations

import json

import pytest
from gguf_fixtures import write_tiny_gguf

import adaspec  # noqa: F401  (loads the fast BLAS before mlx)
from adaspec import doctor
from adaspec.cli import main
from adaspec.kernels import blas


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from adaspec import settings

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path / "cache"))
    settings.get.cache_clear()
    yield tmp_path / "cache"
    settings.get.cache_clear()


def test_collect_without_model():
    import os

    from adaspec.settings import from_env

    d = doctor.collect(settings=from_env({**os.environ, "ADASPEC_GATE": "off"}))
    assert d["mlx"] and d["mlx_lm"] and d["python"] and d["platform"]
    assert d["device"].lower().startswith("device(")
    kinds = ("routed", "mkl", "openblas", "custom", "reference", "system", "off")
    assert d["blas"]["kind"] in kinds
    assert d["gflops_fp32"] > 0
    assert "ADASPEC_BLAS" in d["settings"] and "ADASPEC_CACHE" in d["settings"]
    text = doctor.format_report(d)
    assert "GFLOP/s" in text and "BLAS" in text and "\nmodel " not in text
    assert "  ADASPEC_GATE=off  (default commit)\n" in text and d["settings_changed"]
    json.dumps(d)  # machine-readable as is


def test_collect_with_a_model(tmp_path, cache):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "Q8_0")
    d = doctor.collect(str(tiny.path), repeats=3)
    m = d["model"]
    assert m["load_s"] > 0 and m["forward_1_ms"] > 0 and m["forward_16_ms"] > 0
    assert m["verify_cost_ratio"] == pytest.approx(m["forward_16_ms"] / m["forward_1_ms"])
    sizes = [r["tokens"] for r in m["per_size"]]
    assert sizes == list(doctor.SIZES)
    for r in m["per_size"]:  # each row: its own time, the ratio to 1 token, weights per second
        assert r["ms"] == m[f"forward_{r['tokens']}_ms"]
        assert r["ratio"] == pytest.approx(r["ms"] / m["forward_1_ms"])
        assert r["weights_gbs"] == pytest.approx(m["weight_bytes"] / r["ms"] / 1e6)
        if blas.routed_seconds() is not None:  # the GEMMs' share of the same forward
            assert 0 < r["gemm_ms"] < r["ms"]
    lim = d["limits"]
    assert lim["read_gbs"] > 0 and lim["triad_gbs"] > 0 and lim["peak_gflops"] > 0
    text = doctor.format_report(d)
    assert "verify cost" in text and "roofline" in text and "GB/s" in text
    sx = m["suffix"]  # no data ships for this target: the index holds what the process made
    assert sx["tokens"] == sx["online_tokens"] and sx["build_s"] >= 0
    assert "suffix index" in text
    assert ("GEMM ms" in text) == (blas.routed_seconds() is not None)
    long = m["long_context"]  # the ops outside the GEMMs per token row, at a long context too
    assert long["context"] == doctor.LONG_CONTEXT
    assert [r["tokens"] for r in long["per_size"]] == list(doctor.LONG_SIZES)
    for r in m["per_size"] + long["per_size"]:
        if r["gemm_ms"] is not None:
            assert r["other_ms_per_row"] == pytest.approx((r["ms"] - r["gemm_ms"]) / r["tokens"])
    routed = blas.routed_seconds() is not None
    assert ("outside GEMMs ms per token row at context 2000" in text) == routed
    assert "fast ops" in text and d["fast_ops"]["jit"]
    if d["fast_ops"]["attention"]:  # the model's fast paths and mlx-lm's names, listed
        assert m["fast_ops"]["layers"] > 0 and "model twins" in text
        assert d["fast_ops"]["attention_modules"] and d["fast_ops"]["generate_logsumexp"]


def test_forward_times_on_sizes_without_the_verify_length(tmp_path, cache, monkeypatch):
    from adaspec.targets.loader import load

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "Q8_0")
    model, _ = load(tiny.path)
    monkeypatch.setattr(doctor, "SIZES", (1, 2))  # as `forward_cost.py --sizes 1,2` sets it
    t = doctor.forward_times(model, repeats=2, context=8)
    assert [r["tokens"] for r in t["per_size"]] == [1, 2]
    assert t["verify_cost_ratio"] is None and "forward_16_ms" not in t


class _Recording:
    """A model that records the tokens fed with each cache."""

    def __init__(self, model):
        self.model, self.args, self.fed = model, model.args, []
        self.parameters = model.parameters

    def __call__(self, x, cache=None):
        self.fed.append((x, cache))
        return self.model(x, cache=cache)


def test_forward_times_leave_the_cache_usable(tmp_path, cache):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from adaspec.targets.loader import load

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", "F16")
    model, _ = load(tiny.path)
    timed, recording = make_prompt_cache(model), _Recording(model)
    t = doctor.forward_times(recording, repeats=2, context=8, cache=timed)
    assert t["context"] == 8 and t["verify_cost_ratio"] > 0
    fed = [x for x, c in recording.fed if c is timed]
    assert len(fed) > 1 and fed[0].shape == (1, 8)  # a prefill, then the timed forwards
    # the timed cache continues like a fresh one that saw the prefill alone
    fresh = make_prompt_cache(model)
    model(fed[0], cache=fresh)
    nxt = mx.array([[5, 17, 3]])
    assert timed[0].offset == fresh[0].offset == 8
    assert mx.allclose(model(nxt, cache=timed), model(nxt, cache=fresh), atol=1e-5).item()


def test_cli_doctor_json(capsys):
    assert main(["doctor", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gflops_fp32"] > 0 and "model" not in d


def test_cli_doctor_human_with_model(tmp_path, cache, capsys):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3", "F32")
    assert main(["doctor", "--model", str(tiny.path)]) == 0
    out = capsys.readouterr().out
    assert "verify cost" in out and "fp32 matmul" in out


def test_cli_doctor_bad_model_is_a_clean_error(tmp_path, capsys):
    assert main(["doctor", "--model", str(tmp_path / "nope.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_models_list(cache, capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert name in out
    assert "(default)" in out


def test_cli_models_fetch_unknown(capsys):
    assert main(["models", "fetch", "nope"]) == 2
    assert "unknown catalogue model 'nope'" in capsys.readouterr().err
