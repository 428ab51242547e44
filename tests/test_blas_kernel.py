"""blas_route.c's small-M kernels against numpy, and the router inside a real process."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys

import numpy as np
import pytest

from adaspec.kernels import blas

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not (shutil.which("cc") or shutil.which("gcc")),
    reason="the router is built with the system C compiler on Linux",
)
F32P = ctypes.POINTER(ctypes.c_float)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    # RTLD_LOCAL: this copy's cblas_sgemm does not take over mlx's
    lib = ctypes.CDLL(str(blas.build_router(tmp_path_factory.mktemp("cache"))))
    f = lib.adaspec_small_m_sgemm
    f.argtypes = [ctypes.c_int] * 4 + [ctypes.c_float, F32P, ctypes.c_int, F32P, ctypes.c_int,
                                       ctypes.c_float, F32P, ctypes.c_int]  # fmt: skip
    return f


def ptr(a: np.ndarray):
    return a.ctypes.data_as(F32P)


@pytest.mark.parametrize("trans_b", [1, 0])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 12])
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


def test_routed_process_sends_small_gemms_to_the_kernel_and_prefill_to_the_library():
    code = """
import adaspec, mlx.core as mx, numpy as np
from adaspec.kernels import blas
assert blas.status().kind == "routed", blas.status()
w = mx.random.normal((300, 70))
for m in (1, 5, blas.KERNEL_ROWS, blas.KERNEL_ROWS + 1, 64):
    x = mx.random.normal((m, 70))
    before = blas.routed_calls()
    got = np.array(x @ w.T)
    after = blas.routed_calls()
    np.testing.assert_allclose(got, np.array(x) @ np.array(w).T, rtol=1e-4, atol=1e-4)
    print(m, after[0] - before[0], after[1] - before[1])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    small, big = blas.KERNEL_ROWS, blas.KERNEL_ROWS + 1
    assert [lines[str(m)] for m in (1, 5, small)] == ["1 0"] * 3
    assert [lines[str(m)] for m in (big, 64)] == ["0 1"] * 2
