"""bf16 shadows: the rounding, the kernel that reads them against numpy, which GEMMs they
replace inside mlx (exactly the registered matrix, up to 32 rows, until closed), and a
draft model drafting from them with output identical to greedy AR."""

from __future__ import annotations

import ctypes
import gc
import shutil
import sys

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiny import VOCAB, ar_greedy, byte_tokenizer, save_tiny, tiny_model

from adaspec.drafters.arms import make as make_drafter
from adaspec.drafters.draft_model import DraftLM
from adaspec.errors import DrafterError
from adaspec.kernels import blas, shadow
from adaspec.loop.controller import DecodeConfig, Decoder, decode
from adaspec.settings import from_env
from adaspec.targets.base import target_info
from adaspec.targets.kv import KVTarget

ROUTED = blas.status() is not None and blas.status().kind == blas.ROUTED
needs_router = pytest.mark.skipif(not ROUTED, reason="shadows are read by the routed kernel")
F32P = ctypes.POINTER(ctypes.c_float)


# ---- rounding ------------------------------------------------------------------------------


def test_rounding_is_to_nearest_with_ties_to_even():
    one = np.float32(1.0)
    ulp = np.float32(2.0**-7)  # bf16's spacing at 1.0
    x = np.array(
        [one, one + ulp / 2, one + 3 * ulp / 2, one + ulp / 4, -2.5, np.inf, 0.0],
        dtype=np.float32,
    )
    got = shadow.from_bf16(shadow.to_bf16(x))
    want = [one, one, one + 2 * ulp, one, -2.5, np.inf, 0.0]  # ties go to the even neighbour
    np.testing.assert_array_equal(got, np.array(want, dtype=np.float32))
    assert np.isnan(shadow.from_bf16(shadow.to_bf16(np.array([np.nan], np.float32))))[0]


@given(st.lists(st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=False), min_size=1))
def test_a_bf16_value_is_within_half_a_bf16_step_of_the_fp32_one(values):
    x = np.array(values, dtype=np.float32)
    err = np.abs(shadow.from_bf16(shadow.to_bf16(x)).astype(np.float64) - x)
    assert np.all(err <= np.abs(x.astype(np.float64)) * 2.0**-8)


# ---- the kernel that reads them ---------------------------------------------------------------


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    if not sys.platform.startswith("linux") or not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("the router is built with the system C compiler on Linux")
    lib = ctypes.CDLL(str(blas.build_router(tmp_path_factory.mktemp("cache"))))
    f = lib.adaspec_small_m_sgemm_bf16
    i, f32 = ctypes.c_int, ctypes.c_float
    f.argtypes = [i, i, i, f32, F32P, i, ctypes.c_void_p, i, f32, F32P, i]
    return lib


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 17, 32])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 15), (47, 33), (96, 64), (130, 577)])
def test_the_bf16_kernel_matches_numpy_on_the_widened_weights(router, isa, m, n, k):
    if isa == "avx512" and b"avx512f" not in blas._cpu_flags().split():
        pytest.skip("this CPU has no avx512")
    assert router.adaspec_kernel_isa(blas.ISA_CODES[isa]) == blas.ISA_CODES[isa]
    rng = np.random.default_rng(m * 1000 + n + k)
    a = rng.standard_normal((m, k + 2), dtype=np.float32)
    h = shadow.to_bf16(rng.standard_normal((n, k + 3), dtype=np.float32))
    c = np.full((m, n), np.nan, dtype=np.float32)  # beta 0: C is not read
    router.adaspec_small_m_sgemm_bf16(
        m, n, k, 1.0, a.ctypes.data_as(F32P), k + 2, h.ctypes.data, k + 3, 0.0,
        c.ctypes.data_as(F32P), n,
    )  # fmt: skip
    want = a[:, :k].astype(np.float64) @ shadow.from_bf16(h)[:, :k].T.astype(np.float64)
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4)
    router.adaspec_kernel_isa(0)


# ---- inside mlx -----------------------------------------------------------------------------


def _matrix(n=96, k=64, seed=0):
    w = mx.array(np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32))
    x = mx.array(np.random.default_rng(seed + 1).standard_normal((40, k), dtype=np.float32))
    mx.eval(w, x)
    return w, x


@needs_router
def test_a_registered_matrix_is_read_as_bf16_until_closed():
    w, x = _matrix()
    fp32 = np.array(x[:5] @ w.T)
    widened = np.asarray(x[:5], np.float64) @ shadow.from_bf16(shadow.to_bf16(np.array(w))).T
    before = shadow.shadow_calls()
    s = shadow.Shadows([w])
    assert s.count == 1 and s.nbytes == w.size * 2
    got = np.array(x[:5] @ w.T)
    assert shadow.shadow_calls() > before
    np.testing.assert_allclose(got, widened, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(got, fp32)
    np.testing.assert_array_equal(np.array(x[:1] @ w.T)[0], got[0])  # same bits for any M
    s.close()
    np.testing.assert_array_equal(np.array(x[:5] @ w.T), fp32)


@needs_router
def test_only_the_registered_matrix_and_small_gemms_read_the_shadow():
    w, x = _matrix(seed=2)
    other, _ = _matrix(seed=2)  # equal values, its own memory
    wide = np.array(x @ w.T)  # 40 rows: the BLAS library, fp32
    part = np.array(x[:3] @ w[:50].T)
    s = shadow.Shadows([w])
    np.testing.assert_array_equal(np.array(x @ w.T), wide)
    np.testing.assert_array_equal(np.array(x[:3] @ w[:50].T), part)  # another shape
    np.testing.assert_array_equal(np.array(x[:3] @ other.T), np.array(x[:3] @ other.T))
    assert not np.array_equal(np.array(x[:3] @ w.T), np.array(x[:3] @ other.T))
    s.close()


@needs_router
def test_dropping_the_shadows_unregisters_them():
    w, x = _matrix(seed=4)
    fp32 = np.array(x[:2] @ w.T)
    s = shadow.Shadows([w, mx.zeros((3,)), w.astype(mx.float16)])  # 1-D and fp16: not shadowed
    assert s.count == 1
    del s
    gc.collect()
    np.testing.assert_array_equal(np.array(x[:2] @ w.T), fp32)
    again = shadow.Shadows([w])  # and it can be shadowed again
    with pytest.raises(DrafterError, match="already has a shadow"):
        shadow.Shadows([w])
    again.close()


def test_without_the_routed_kernel_bf16_is_refused(monkeypatch):
    monkeypatch.setattr(blas, "status", lambda: blas.BlasStatus("mkl", "mkl"))
    with pytest.raises(DrafterError, match=r"weights=bf16 needs .*BLAS in use: mkl.*weights=fp32"):
        shadow.Shadows([])


def test_auto_means_q4_or_q8_with_vnni_else_bf16_where_the_routed_kernel_runs_else_fp32(
    monkeypatch,
):
    assert shadow.resolve("fp32", "x") == "fp32" and shadow.resolve("bf16", "x") == "bf16"
    vnni = ROUTED and blas.kernel_isa() and blas._router.adaspec_q8_kernel() == shadow.Q8_VNNI
    other = "bf16" if ROUTED and blas.kernel_isa() else "fp32"
    assert shadow.resolve("auto", "x") == ("q4" if vnni else other)
    without_q4 = ("auto", "fp32", "bf16", "q8")  # what a DFlash drafter takes
    assert shadow.resolve("auto", "x", without_q4) == ("q8" if vnni else other)
    monkeypatch.setattr(blas, "status", lambda: blas.BlasStatus("mkl", "mkl"))
    assert shadow.resolve("auto", "x") == "fp32"


# ---- a draft model drafting from them --------------------------------------------------------

TOK = byte_tokenizer()


@needs_router
@pytest.mark.parametrize("head", [0, 64])
def test_a_bf16_draft_model_stays_lossless(tmp_path, head):
    target = tiny_model("qwen3")
    folder = save_tiny(tiny_model("qwen3", vocab=300, seed=7, layers=1), TOK, tmp_path / "draft")
    s = from_env({}, cache=str(tmp_path / "cache"))
    spec = f"draft-model:{folder},weights=bf16" + (f",head={head}" if head else "")
    d = make_drafter(spec, target_info(target, TOK), s)
    assert isinstance(d, DraftLM) and (d.head_shadows is not None) == bool(head)
    if head:  # the gathered head rows are read as bf16 too
        project = d._head[1]
        h = mx.array(np.random.default_rng(0).standard_normal((1, 1, 64), dtype=np.float32))
        rows = shadow.from_bf16(shadow.to_bf16(np.array(project.weight)))
        want = np.asarray(h, np.float64).reshape(1, -1) @ rows.T
        got = np.array(project(h)).reshape(1, -1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        fp32 = np.asarray(h, np.float64).reshape(1, -1) @ np.array(project.weight, np.float64).T
        assert not np.allclose(got, fp32, rtol=1e-4, atol=1e-4)
    before = shadow.shadow_calls()
    prompt = [5, 6, 7, 8, 9, 10, 11, 40, 41]
    dec = Decoder(KVTarget(target, TOK), d, DecodeConfig(max_tokens=24, max_draft=4))
    assert [e.token for e in decode(dec, prompt)] == ar_greedy(target, prompt, 24)
    assert dec.stats.drafted > 0 and shadow.shadow_calls() > before


def test_an_unknown_weights_value_is_refused_naming_it(tmp_path):
    folder = save_tiny(tiny_model("qwen3", vocab=VOCAB, seed=7, layers=1), TOK, tmp_path / "d")
    s = from_env({}, cache=str(tmp_path / "cache"))
    info = target_info(tiny_model("qwen3"), TOK)
    bad = r"draft-model weights='int4' is invalid; accepted: auto, fp32, bf16, q8"
    with pytest.raises(DrafterError, match=bad):
        make_drafter(f"draft-model:{folder},weights=int4", info, s)


# ---- a DFlash drafter drafting from them -------------------------------------------------------


@needs_router
@pytest.mark.parametrize("with_set", [True, False], ids=["restricted-head", "full-head"])
def test_a_bf16_dflash_drafter_shadows_only_its_own_weights(tmp_path, with_set):
    from mlx.utils import tree_flatten
    from tiny_dflash import tiny_drafter

    from adaspec.drafters import dflash
    from adaspec.drafters.dflash_checkpoint import save_model

    target = tiny_model("llama")
    prompt = [5, 6, 7, 8, 9, 10, 11, 40, 41, 5, 6, 7]
    want = ar_greedy(target, prompt, 24)  # before any shadow exists
    ids = np.arange(0, VOCAB, 2, dtype=np.int32) if with_set else None
    save_model(tiny_drafter(target, seed=3, block=4).model, tmp_path / "d", head_token_ids=ids)
    d = dflash.load(tmp_path / "d", target_info(target), weights="bf16")
    fp32 = dflash.load(tmp_path / "d", target_info(target))
    assert fp32.model is not d.model and fp32.shadows is None  # a copy of its own
    own = set(d.shadows.addresses) | set(d.head_shadows.addresses if d.head_shadows else ())
    assert (d.head_shadows is not None) == with_set
    targets = {np.asarray(memoryview(a)).ctypes.data for _, a in tree_flatten(target.parameters())}
    assert own and not own & targets
    before = shadow.shadow_calls()
    dec = Decoder(KVTarget(target), d, DecodeConfig(max_tokens=24))
    assert [e.token for e in decode(dec, prompt)] == want
    assert dec.stats.drafted > 0 and shadow.shadow_calls() > before
    with pytest.raises(DrafterError, match=r"dflash weights='fp16' is invalid; accepted: auto"):
        dflash.load(tmp_path / "d", target_info(target), weights="fp16")
