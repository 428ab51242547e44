"""mlx primitives of adaspec's own, compiled against the installed mlx: a computation of many
graph nodes in one. One C++ file per primitive (native_attention.cpp: attention;
native_kv_attention.cpp: RoPE, the KV cache write and attention; native_linears.cpp: several
projections of one input; native_decoder_layer.cpp: a llama / qwen2 decoder layer;
native_stored_rows.cpp: a stored embedding's rows), what they share in native.h, the Python
bindings in native_module.cpp.

On a small model mlx's fixed cost per graph node (the Python thread's eval and hand-off of each
node to the stream thread) outweighs most of the ops themselves, so a node that does the work
of ten pays even where the arithmetic is the same. The extension is built once per source, mlx,
nanobind, Python and CPU (`g++ -std=c++20 -O3 -march=native -ffp-contract=off`, with nanobind's
sources and mlx's headers from their wheels) into ADASPEC_CACHE/kernels, and loaded from there
(`-fno-trapping-math` lets `exp`'s selects vectorize; it changes no value, as for mlx's JIT
kernels in kernels/jit.py). mlx's Python arrays cross into it only when nanobind's ABI and
domain match those mlx was built with (nanobind 3, domain `mlx`); a smoke test checks that at
load. When anything is missing (a compiler, Python's headers, a matching nanobind) `get()`
returns None with the reason in `status()`, and callers keep the graph of mlx ops.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ..settings import get as get_settings
from .blas import _cpu_flags, compile_into

HERE = Path(__file__).parent
SOURCES = tuple(HERE / f"native_{n}.cpp" for n in (
    "attention", "kv_attention", "linears", "decoder_layer", "stored_rows", "module",
))  # fmt: skip
HEADER = HERE / "native.h"
MODULE = "_adaspec_native"


@dataclass(frozen=True)
class NativeStatus:
    active: bool
    reason: str  # why not, when not active
    path: str | None = None


_status: NativeStatus | None = None
_module: Any = None


def _versions() -> bytes:
    parts = [sys.version.split()[0], sysconfig.get_config_var("EXT_SUFFIX") or ""]
    for dist in ("mlx", "nanobind"):
        try:
            parts.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist}=missing")
    return "|".join(parts).encode()


def _command(out: Path) -> list[str]:
    import mlx.core as mx
    import nanobind

    nb = Path(nanobind.__file__).parent
    mlx_dir = Path(mx.__file__).parent if mx.__file__ else None
    if mlx_dir is None or not (mlx_dir / "include").is_dir():
        raise OSError("mlx's headers (mlx/include) are not installed")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise OSError("no C++ compiler found (set CXX)")
    py_include = sysconfig.get_paths()["include"]
    if not Path(py_include, "Python.h").exists():
        raise OSError(f"Python's headers are missing ({py_include}/Python.h)")
    lib = mlx_dir / "lib"
    return [
        cxx, "-std=c++20", "-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math",
        "-shared", "-fPIC",
        "-fvisibility=hidden", "-DNDEBUG", "-DNB_DOMAIN=mlx",
        f"-I{nb / 'include'}", f"-I{nb / 'ext' / 'robin_map' / 'include'}", f"-I{py_include}",
        f"-I{mlx_dir / 'include'}", *map(str, SOURCES), str(nb / "src" / "nb_combined.cpp"),
        f"-L{lib}", "-lmlx", f"-Wl,-rpath,{lib}", "-o", str(out),
    ]  # fmt: skip


def build(cache: Path) -> Path:
    """Compile the extension into `cache`/kernels once (a key of the source, the versions of
    Python, mlx and nanobind and this CPU's flags); returns its path."""
    text = b"".join(p.read_bytes() for p in (*SOURCES, HEADER))
    key = hashlib.sha256(text + _versions() + _cpu_flags()).hexdigest()[:12]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out = cache / "kernels" / f"native-{key}" / f"{MODULE}{suffix}"
    if out.exists():
        return out
    return compile_into(out, _command)


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _smoke(module: Any) -> None:
    """mlx's arrays must cross into the module (nanobind's ABI and domain match mlx's)."""
    import mlx.core as mx

    q = mx.ones((1, 2, 1, 4))
    k = mx.ones((1, 1, 3, 4))
    out = module.attention_core(q, k, k, 0.5, False, True, None)
    mx.eval(out)
    if out.shape != (1, 2, 1, 4):
        raise RuntimeError(f"smoke test gave shape {out.shape}")


def get() -> Any:
    """The loaded extension, or None (status() says why). Built and loaded on first call."""
    global _status, _module
    if _status is None:
        try:
            path = build(get_settings().cache)
            module = _load(path)
            _smoke(module)
        except Exception as exc:  # any failure keeps the graph of mlx ops
            _status = NativeStatus(False, f"{type(exc).__name__}: {str(exc)[:300]}")
        else:
            _module, _status = module, NativeStatus(True, "", str(path))
    return _module


def status() -> NativeStatus | None:
    """None until get() was called."""
    return _status
