"""mlx's compiled CPU kernels built for this CPU (adaspec/kernels/jit.py) give stock mlx's bits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import adaspec  # noqa: F401  (installs the JIT wrapper)
from adaspec.kernels import jit

ACTIVE = jit.status() is not None and jit.status().active
needs_jit = pytest.mark.skipif(not ACTIVE, reason="the JIT wrapper is for Linux x86-64 with g++")

# Every compiled op that mlx-lm's models use, by name: mlx.nn's activations and mlx-lm's
# SwiGLU variants (each an mx.compile kernel), and the kernels of kernels/attention.py.
OPS = """
import mlx.core as mx, mlx.nn as nn
from mlx_lm.models import activations as act
from adaspec.kernels import softmax as sm
OPS = {
    "silu": nn.silu, "sigmoid": nn.sigmoid, "gelu": nn.gelu, "gelu_approx": nn.gelu_approx,
    "gelu_fast_approx": nn.gelu_fast_approx, "softplus": nn.softplus, "mish": nn.mish,
    "log_sigmoid": nn.log_sigmoid, "selu": nn.selu, "elu": nn.elu, "celu": nn.celu,
    "relu2": nn.relu2, "hardswish": nn.hardswish,
    "swiglu": lambda x: act.swiglu(x, x[::-1]),
    "precise_swiglu": lambda x: act.precise_swiglu(x, x, x[::-1]),
    "swiglu_oai": lambda x: act.swiglu_oai(x, x[::-1]),
    "exp_shifted": lambda x: sm.exp_shifted(x, x[:1]),
}
"""

# Run by a fresh interpreter with ADASPEC_FAST_OPS=off, the wrapper off PATH and an empty TMPDIR:
# stock mlx compiles each kernel with its own flags.
STOCK = (
    OPS
    + """
import sys, numpy as np
x = mx.array(np.load(sys.argv[1]))
np.savez(sys.argv[2], **{k: np.array(f(x)) for k, f in OPS.items()})
"""
)


def special_values() -> np.ndarray:
    """Random normals at several scales plus the edges of exp: denormals, +-0, +-inf, NaN,
    huge |x|, the |x| > 88 cut-offs and the round-half points of x / ln 2."""
    rng = np.random.default_rng(0)
    tiny = np.finfo(np.float32).smallest_subnormal
    edges = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, tiny, -tiny, 1e-40, -1e-40]
    edges += [1e-38, -1e-38, 88.0, -88.0, 88.000008, -88.000008, 87.99999, -87.99999, 89.0]
    edges += [-89.0, 1e30, -1e30, np.finfo(np.float32).max, np.finfo(np.float32).min, 0.5, -0.5]
    edges += list(np.log(2) * (np.arange(-130, 130) + 0.5))
    parts = [rng.standard_normal(20000) * s for s in (1, 4, 30, 100)]
    parts.append(rng.uniform(-90, 90, 20000))
    x = np.concatenate([np.array(edges), *parts]).astype(np.float32)
    nan_payload = np.array([0x7FC00123, 0xFFC00001], dtype=np.uint32).view(np.float32)
    return np.concatenate([x, nan_payload])


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype == np.float32 else np.uint8)


def differences(ours: np.ndarray, stock: np.ndarray) -> int:
    """Positions whose bits differ, a NaN's sign and payload aside: where a multiply meets two
    NaNs x86 returns the first operand's, and the compiler orders commutative operands freely
    (stock SwiGLU gives +NaN for x = -NaN, ours -NaN). Both are NaN: nothing else differs."""
    nan = np.isnan(ours)
    return int((nan != np.isnan(stock)).sum() + (bits(ours) != bits(stock))[~nan].sum())


@needs_jit
def test_compiled_ops_equal_stock_mlx_bit_for_bit(tmp_path: Path) -> None:
    x = special_values()
    np.save(tmp_path / "x.npy", x)
    env = {**os.environ, "TMPDIR": str(tmp_path / "stock-tmp"), "ADASPEC_FAST_OPS": "off"}
    env["PATH"] = os.pathsep.join(
        d for d in env["PATH"].split(os.pathsep) if not jit._is_wrapper(Path(d) / "g++")
    )
    (tmp_path / "stock-tmp").mkdir()
    subprocess.run(
        [sys.executable, "-c", STOCK, str(tmp_path / "x.npy"), str(tmp_path / "out.npz")],
        check=True,
        env=env,
        timeout=600,
    )
    stock = np.load(tmp_path / "out.npz")
    scope: dict = {}
    exec(OPS, scope)
    import mlx.core as mx

    ours = {k: np.array(f(mx.array(x))) for k, f in scope["OPS"].items()}
    differ = {k: differences(ours[k], stock[k]) for k in ours}
    assert not any(differ.values()), json.dumps(differ)
    # the stock run built its kernels with mlx's own flags, ours with the wrapper's
    stock_libs = list((tmp_path / "stock-tmp").rglob("*.so"))
    assert stock_libs, "stock mlx compiled nothing"
    for lib in stock_libs:
        asm = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
        assert "vfmadd" not in asm, lib.name
    kernel_dir = jit.status().kernel_dir(mx.__version__)
    assert any(p.name.endswith(".so") for p in kernel_dir.iterdir())


@needs_jit
def test_kernels_are_vectorized_with_fma() -> None:
    import mlx.core as mx

    from adaspec.kernels import softmax

    x = mx.arange(64, dtype=mx.float32)
    mx.eval(softmax.exp_shifted(x, x[:1]))
    kernel_dir = jit.status().kernel_dir(mx.__version__)
    # the kernel just built for exp(x - max): its name depends on how mlx fused the graph
    libs = [p for p in kernel_dir.glob("lib*.so") if "Subtract" in p.name and "OExp" in p.name]
    assert libs, sorted(p.name for p in kernel_dir.glob("lib*.so"))
    lib = max(libs, key=lambda p: p.stat().st_mtime)
    asm = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "vfmadd" in asm and ("ymm" in asm or "zmm" in asm)
    assert "fmaf" not in asm and "simd3exp" not in asm  # no calls left in the loop


def test_wrapper_adds_flags_only_for_mlx_kernels(tmp_path: Path) -> None:
    bindir, tmpdir = jit.prepare(tmp_path, "/bin/echo")
    wrapper = bindir / "g++"
    kernel = tmpdir / "mlx" / "0.0.0" / "cpu" / "k.cpp"
    ours = subprocess.run([wrapper, "-O3", str(kernel)], capture_output=True, text=True).stdout
    other = subprocess.run([wrapper, "-O3", "/src/x.cpp"], capture_output=True, text=True).stdout
    assert ours.split() == ["-O3", str(kernel), *jit.FLAGS]
    assert other.split() == ["-O3", "/src/x.cpp"]
    assert jit._is_wrapper(wrapper) and not jit._is_wrapper(Path("/bin/echo"))


def test_real_compiler_passes_over_wrappers(tmp_path: Path, monkeypatch) -> None:
    bindir, _ = jit.prepare(tmp_path, "/bin/echo")
    real = tmp_path / "real"
    real.mkdir()
    (real / "g++").write_text("#!/bin/sh\n")
    (real / "g++").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{real}")
    assert jit.real_compiler() == str(real / "g++")


@pytest.mark.parametrize(
    ("machine", "system", "ok"),
    [("x86_64", "linux", True), ("AMD64", "linux", True), ("arm64", "darwin", False)]
    + [("aarch64", "linux", False), ("x86_64", "win32", False)],
)
def test_supported_platforms(machine: str, system: str, ok: bool) -> None:
    reason = jit.supported(machine, system)
    assert (reason is None) == ok
    if not ok:
        assert machine in reason or system in reason
