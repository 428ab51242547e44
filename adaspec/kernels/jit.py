"""mlx's CPU JIT kernels (`mx.compile`: SiLU, SwiGLU, ...) built for this CPU, with the same bits.

mlx 0.32 builds each compiled CPU kernel with `g++ -std=c++17 -O3` found on PATH and no target
flags (jit_compiler.cpp), into `<TMPDIR>/mlx/<version>/cpu`, so every `fma` in its `exp` is a
call to glibc's `fmaf` and nothing is vectorized. `install` puts a `g++` wrapper first on PATH
that adds `-march=native -ffp-contract=off` for mlx's kernels only, and points TMPDIR at a cache
of our own (kernels built by stock mlx are never reused, and stock mlx never reuses ours). An FMA
instruction rounds once like `fmaf`, floor and the conversions are exact, and contraction stays
off, so each kernel gives stock mlx's bits (tests/test_ops_jit.py; benchmarks/exp_exhaustive.py
checks `exp` over all 2^32 fp32 inputs).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .blas import _cpu_flags

# -fno-semantic-interposition and the inline limit let mlx's `exp` template inline into the
# kernel, -fno-trapping-math lets its selects (NaN, |x| > 88) be if-converted so the loop
# vectorizes; none changes a value (contraction stays off)
FLAGS = (
    "-march=native",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-fno-semantic-interposition",
    "--param=max-inline-insns-auto=200",
)
WRAPPER_VERSION = b"3"  # bump when the wrapper's text changes


@dataclass(frozen=True)
class JitStatus:
    active: bool
    directory: Path | None = None  # TMPDIR given to mlx: kernels land in <it>/mlx/<ver>/cpu
    reason: str | None = None  # why it is not active

    def kernel_dir(self, mlx_version: str) -> Path | None:
        return self.directory / "mlx" / mlx_version / "cpu" if self.directory else None


def supported(machine: str | None = None, system: str | None = None) -> str | None:
    """None where the wrapper applies (Linux x86-64), else why not."""
    machine = (machine or platform.machine()).lower()
    system = system or sys.platform
    if not system.startswith("linux"):
        return f"platform {system}: mlx's JIT wrapper is for Linux"
    if machine not in ("x86_64", "amd64"):
        return f"machine {machine}: mlx's JIT wrapper is for x86-64"
    return None


def wrapper_text(compiler: str, tmpdir: Path) -> str:
    """A g++ that adds FLAGS when it builds a kernel of mlx's in `tmpdir`, and is plain g++
    for every other caller (child processes inherit PATH)."""
    real, mark = shlex.quote(compiler), str(tmpdir / "mlx") + "/"
    return (
        "#!/bin/sh\n"
        "# mlx's CPU JIT kernels, built for this CPU (adaspec/kernels/jit.py)\n"
        f'case "$*" in\n'
        f'  *{shlex.quote(mark)}*) exec {real} "$@" {" ".join(FLAGS)} ;;\n'
        "esac\n"
        f'exec {real} "$@"\n'
    )


def prepare(cache: Path, compiler: str) -> tuple[Path, Path]:
    """Write the wrapper once into `cache`/jit/<key>/bin; returns (bin dir, TMPDIR for mlx).
    The key is this CPU's flags and the compiler, so a shared cache never mixes CPUs."""
    key = hashlib.sha256(_cpu_flags() + compiler.encode() + WRAPPER_VERSION).hexdigest()[:12]
    root = cache / "jit" / key
    bindir, tmpdir = root / "bin", root / "tmp"
    wrapper = bindir / "g++"
    text = wrapper_text(compiler, tmpdir)
    if not wrapper.exists() or wrapper.read_text() != text:
        bindir.mkdir(parents=True, exist_ok=True)
        tmp = wrapper.with_name(f"g++.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, wrapper)
    tmpdir.mkdir(parents=True, exist_ok=True)
    return bindir, tmpdir


def real_compiler() -> str | None:
    """g++ on PATH, passing over wrappers of ours (a child process inherits the PATH)."""
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    for d in dirs:
        hit = shutil.which("g++", path=d)
        if hit and not _is_wrapper(Path(hit)):
            return os.path.realpath(hit)
    return None


def _is_wrapper(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return b"adaspec/kernels/jit.py" in f.read(200)
    except OSError:
        return False


_status: JitStatus | None = None


def install(cache: Path, enabled: bool = True) -> JitStatus:
    """Once per process: route mlx's CPU JIT through the wrapper (PATH, TMPDIR). Python's own
    tempfile directory is fixed first, so only mlx sees the new TMPDIR."""
    global _status
    if _status is not None:
        return _status
    compiler = real_compiler()
    reason = (
        "ADASPEC_FAST_OPS=off"
        if not enabled
        else supported() or (None if compiler else "no g++ on PATH (mlx cannot compile either)")
    )
    if reason or compiler is None:
        _status = JitStatus(False, reason=reason)
        return _status
    try:
        bindir, tmpdir = prepare(cache, compiler)
    except OSError as exc:
        _status = JitStatus(False, reason=f"cache {cache} not writable: {exc}")
        return _status
    tempfile.gettempdir()  # pin Python's temp dir before TMPDIR changes
    os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ["TMPDIR"] = str(tmpdir)
    _status = JitStatus(True, tmpdir)
    return _status


def status() -> JitStatus | None:
    return _status
