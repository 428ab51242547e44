"""blas_route.c's small-M kernels against numpy, and the router inside a real process."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaspec.kernels import blas

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not (shutil.which("cc") or shutil.which("gcc")),
    reason="the router is built with the system C compiler on Linux",
)
F32P = ctypes.POINTER(ctypes.c_float)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    # RTLD_LOCAL: this copy's cblas_sgemm does not take over mlx's
    return ctypes.CDLL(str(blas.build_router(tmp_path_factory.mktemp("cache"))))


def isas_here() -> list[str]:
    """The instruction sets this CPU runs: avx2 always (the test is skipped without it),
    avx512 where the CPU has AVX-512 F."""
    flags = blas._cpu_flags().split()
    return ["avx2"] + (["avx512"] if b"avx512f" in flags else [])


@pytest.fixture(scope="module", params=["avx2", "avx512"])
def kernel(router, request):
    if request.param not in isas_here():
        pytest.skip(f"this CPU has no {request.param}")
    assert router.adaspec_kernel_isa(blas.ISA_CODES[request.param]) == blas.ISA_CODES[request.param]
    f = router.adaspec_small_m_sgemm
    f.argtypes = [ctypes.c_int] * 4 + [ctypes.c_float, F32P, ctypes.c_int, F32P, ctypes.c_int,
                                       ctypes.c_float, F32P, ctypes.c_int]  # fmt: skip
    yield f
    router.adaspec_kernel_isa(0)


def ptr(a: np.ndarray):
    return a.ctypes.data_as(F32P)


@pytest.mark.parametrize("trans_b", [1, 0])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 12, 13, 24, 32])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 8), (47, 9), (96, 64), (97, 577), (200, 7)])
def test_kernel_matches_numpy(kernel, trans_b, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    pad = 3  # leading dimensions wider than the matrices
    a = rng.standard_normal((m, k + pad), dtype=np.float32)
    b_shape = (n, k + pad) if trans_b else (k, n + pad)
    b = rng.standard_normal(b_shape, dtype=np.float32)
    for alpha, beta in ((1.0, 0.0), (0.5, 2.0)):
        c = rng.standard_normal((m, n + pad), dtype=np.float32)
        if beta == 0.0:
            c[:, :n] = np.nan  # beta 0 must not read C
        before = c.copy()
        bm = b[:, :k].T if trans_b else b[:, :n]
        want = alpha * (a[:, :k].astype(np.float64) @ bm) + beta * np.nan_to_num(before[:, :n])
        kernel(trans_b, m, n, k, alpha, ptr(a), k + pad, ptr(b), b.shape[1], beta, ptr(c), n + pad)
        np.testing.assert_allclose(c[:, :n], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(c[:, n:], before[:, n:])  # padding untouched


def gemm_nt(kernel, a, b, k):
    """C = A B^T through the kernel, for A (m x >= k) and B (n x >= k) row-major"""
    c = np.zeros((a.shape[0], b.shape[0]), dtype=np.float32)
    kernel(1, a.shape[0], b.shape[0], k, 1.0, ptr(a), a.shape[1], ptr(b), b.shape[1], 0.0,
           ptr(c), c.shape[1])  # fmt: skip
    return c


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 32),
    n=st.integers(1, 300),
    k=st.integers(1, 700),
    seed=st.integers(0, 2**16),
)
def test_a_rows_result_does_not_depend_on_the_other_rows(kernel, m, n, k, seed):
    """Bit for bit: row i of an M-row GEMM equals the same row computed alone, and equals it
    inside any other batch of rows, so a verify's logits equal a 1-token step's."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((n, k), dtype=np.float32)
    together = gemm_nt(kernel, a, b, k)
    np.testing.assert_allclose(together, a.astype(np.float64) @ b.T, rtol=1e-4, atol=1e-3)
    alone = np.concatenate([gemm_nt(kernel, a[i : i + 1], b, k) for i in range(m)])
    assert np.array_equal(together, alone)
    odd = a[m // 2 :]  # a different batch holding the same rows
    assert np.array_equal(gemm_nt(kernel, odd, b, k), together[m // 2 :])


def gemm_nn(f, a, b):
    """C = A B through the kernel for B not transposed (attention's scores @ V)"""
    c = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    f(0, a.shape[0], b.shape[1], a.shape[1], 1.0, ptr(a), a.shape[1], ptr(b), b.shape[1], 0.0,
      ptr(c), c.shape[1])  # fmt: skip
    return c


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 32), n=st.integers(1, 200), k=st.integers(1, 300), seed=st.integers(0, 2**16)
)
def test_scores_at_v_are_the_same_bits_on_every_isa_and_batch(router, m, n, k, seed):
    """B not transposed (attention's scores @ V): exact on small integers, and with random
    floats every instruction set, every batch of rows and either thread's share give each
    output the same bits (one fused multiply-add after another, k in order)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-8, 9, (m, k)).astype(np.float32)
    b = rng.integers(-8, 9, (k, n)).astype(np.float32)
    f = router.adaspec_small_m_sgemm
    f.argtypes = [ctypes.c_int] * 4 + [ctypes.c_float, F32P, ctypes.c_int, F32P, ctypes.c_int,
                                       ctypes.c_float, F32P, ctypes.c_int]  # fmt: skip
    a2 = rng.standard_normal((m, k), dtype=np.float32)
    b2 = rng.standard_normal((k, n), dtype=np.float32)
    per_isa = []
    try:
        for isa in isas_here():
            assert router.adaspec_kernel_isa(blas.ISA_CODES[isa]) == blas.ISA_CODES[isa]
            assert np.array_equal(gemm_nn(f, a, b), a.astype(np.float64) @ b), isa
            together = gemm_nn(f, a2, b2)
            alone = np.concatenate([gemm_nn(f, a2[i : i + 1], b2) for i in range(m)])
            assert np.array_equal(together, alone), isa
            per_isa.append(together)
    finally:
        router.adaspec_kernel_isa(0)
    assert all(np.array_equal(per_isa[0], x) for x in per_isa[1:])


def test_the_kernel_knob_chooses_the_instruction_set(router):
    assert router.adaspec_kernel_isa(blas.ISA_CODES["avx2"]) == blas.ISA_CODES["avx2"]
    assert router.adaspec_kernel_isa(-1) == blas.ISA_CODES["avx2"]  # -1 asks, changes nothing
    best = router.adaspec_kernel_isa(0)
    assert best == blas.ISA_CODES[isas_here()[-1]]
    if "avx512" not in isas_here():  # refused, and the kernel stays as it was
        assert router.adaspec_kernel_isa(blas.ISA_CODES["avx512"]) == -1
        assert router.adaspec_kernel_isa(-1) == best
    code = """
import adaspec, warnings
from adaspec.kernels import blas
print(blas.kernel_isa())
"""
    env = {**os.environ, "ADASPEC_KERNEL_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["avx2"]
    env["ADASPEC_KERNEL_ISA"] = "avx512"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    if "avx512" in isas_here():
        assert out.stdout.split() == ["avx512"]
    else:  # said, not silently ignored
        assert out.stdout.split() == ["avx2"]
        assert "ADASPEC_KERNEL_ISA=avx512: this CPU cannot run it" in out.stderr


def test_routed_process_sends_small_gemms_to_the_kernel_and_prefill_to_the_library():
    code = """
import adaspec, mlx.core as mx, numpy as np
from adaspec.kernels import blas
assert blas.status().kind == "routed", blas.status()
w = mx.random.normal((300, 70))
for m in (1, 5, blas.KERNEL_ROWS, blas.KERNEL_ROWS + 1, 64):
    x = mx.random.normal((m, 70))
    before, t0 = blas.routed_calls(), blas.routed_seconds()
    got = np.array(x @ w.T)
    after, t1 = blas.routed_calls(), blas.routed_seconds()
    np.testing.assert_allclose(got, np.array(x) @ np.array(w).T, rtol=1e-4, atol=1e-4)
    timed = [int(b > a) for a, b in zip(t0, t1)]  # the time went where the call went
    print(m, after[0] - before[0], after[1] - before[1], *timed)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    small, big = blas.KERNEL_ROWS, blas.KERNEL_ROWS + 1
    assert [lines[str(m)] for m in (1, 5, small)] == ["1 0 1 0"] * 3
    assert [lines[str(m)] for m in (big, 64)] == ["0 1 0 1"] * 2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_verify_gives_the_logits_of_one_token_steps_bit_for_bit(arch):
    """Through a whole model on the routed BLAS: the logits of M tokens verified in one forward
    equal those of M 1-token steps exactly, for every M the kernel takes."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    from tiny import tiny_model

    if blas.status() is None or blas.status().kind != "routed":
        pytest.skip("the routed BLAS is not loaded in this process")
    model = tiny_model(arch)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[(7 * i) % 200 + 3 for i in range(40)]]), cache=cache))
    drafts = [(13 * i) % 250 + 1 for i in range(blas.KERNEL_ROWS)]
    steps = [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in drafts]
    trim_prompt_cache(cache, len(drafts))
    for m in (2, 5, 8, 16, blas.KERNEL_ROWS):
        verify = np.array(model(mx.array([drafts[:m]]), cache=cache)[0])
        trim_prompt_cache(cache, m)
        assert all(np.array_equal(verify[i], steps[i]) for i in range(m)), m
