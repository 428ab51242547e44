"""Load an optimized BLAS into the process before mlx.core does, on Linux.

The mlx-cpu wheel bundles a reference BLAS (~5-7 fp32 GFLOP/s here); mlx resolves cblas symbols
at load time, so a library opened earlier with RTLD_GLOBAL wins (MKL measured ~170 GFLOP/s).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

FAST_KINDS = ("mkl", "openblas")
FIX = (
    "install the 'mkl' wheel (pip install mkl) or Debian's libopenblas0-pthread, and import "
    "adaspec before mlx; set ADASPEC_BLAS=off to silence this"
)


@dataclass(frozen=True)
class BlasStatus:
    requested: str
    kind: str  # mkl | openblas | custom | reference | system | off
    library: str | None = None
    warning: str | None = None

    @property
    def fast(self) -> bool:
        return self.kind in (*FAST_KINDS, "custom", "system")


def _prefixes() -> list[Path]:
    seen: list[Path] = []
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix):
        if Path(p) not in seen:
            seen.append(Path(p))
    return seen


def find_mkl() -> str | None:
    dirs = [p / "lib" for p in _prefixes()]
    dirs += [Path(d) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for d in dirs:
        hits = sorted(glob.glob(str(d / "libmkl_rt.so*")))
        if hits:
            return hits[0]
    return ctypes.util.find_library("mkl_rt")


def find_openblas() -> str | None:
    for cand in (
        "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
        "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    ):
        if os.path.exists(cand):
            return cand
    return ctypes.util.find_library("openblas")


def loaded_fast_blas(maps: str = "/proc/self/maps") -> str | None:
    """Path of an optimized BLAS already mapped into this process, if any."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        path = line.split()[-1] if line.split() else ""
        name = os.path.basename(path)
        if name.startswith(("libmkl_rt", "libopenblas")):
            return path
    return None


Finders = Mapping[str, Callable[[], str | None]]
DEFAULT_FINDERS: Finders = {"mkl": find_mkl, "openblas": find_openblas}


def setup(
    requested: str = "auto",
    *,
    platform: str = sys.platform,
    modules: Iterable[str] = sys.modules,
    finders: Finders = DEFAULT_FINDERS,
    loader: Callable[[str], object] = lambda p: ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL),
    already_loaded: Callable[[], str | None] = loaded_fast_blas,
) -> BlasStatus:
    """Load the requested BLAS (auto: MKL, then OpenBLAS); never raises for a missing library."""
    if requested == "off":
        return BlasStatus(requested, "off")
    if not platform.startswith("linux"):
        return BlasStatus(requested, "system")
    present = already_loaded()
    if present:
        kind = "mkl" if "mkl" in os.path.basename(present) else "openblas"
        return BlasStatus(requested, kind, present)
    if "mlx.core" in modules:
        return BlasStatus(
            requested,
            "reference",
            warning="mlx.core was imported before adaspec, so its "
            f"bundled reference BLAS (~20x slower) is in use; {FIX}",
        )
    if requested in FAST_KINDS or requested == "auto":
        order = FAST_KINDS if requested == "auto" else (requested,)
        for kind in order:
            path = finders[kind]()
            if path:
                try:
                    loader(path)
                    return BlasStatus(requested, kind, path)
                except OSError as exc:
                    last = f"{path}: {exc}"
                    continue
        detail = f" ({last})" if "last" in locals() else ""
        return BlasStatus(
            requested,
            "reference",
            warning=f"no optimized BLAS found for ADASPEC_BLAS="
            f"{requested}{detail}; mlx uses its reference BLAS (~20x slower); {FIX}",
        )
    try:
        loader(requested)
    except OSError as exc:
        return BlasStatus(
            requested,
            "reference",
            warning=f"ADASPEC_BLAS={requested} could not be "
            f"loaded ({exc}); accepted: auto, mkl, openblas, off, or a loadable library path",
        )
    return BlasStatus(requested, "custom", requested)


_status: BlasStatus | None = None


def ensure(requested: str | None = None) -> BlasStatus:
    """Run `setup` once per process (from ADASPEC_BLAS by default) and warn once if slow."""
    global _status
    if _status is None:
        if requested is None:
            from ..settings import from_env

            env = {k: v for k, v in os.environ.items() if k == "ADASPEC_BLAS"}
            requested = from_env(env).blas
        _status = setup(requested)
        if _status.warning:
            warnings.warn(_status.warning, RuntimeWarning, stacklevel=3)
    return _status


def status() -> BlasStatus | None:
    return _status
