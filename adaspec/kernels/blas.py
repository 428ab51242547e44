"""Load an optimized BLAS into the process before mlx.core does, on Linux.

The mlx-cpu wheel bundles a reference BLAS (~5-7 fp32 GFLOP/s here); mlx resolves cblas symbols
at load time, so a library opened earlier with RTLD_GLOBAL wins (MKL measured ~170 GFLOP/s).

The BLAS libraries pack the weight matrix for every GEMM with more than one row, so verifying
a few drafted tokens cost 1.5-1.9x a 1-token step (docs/benchmarks.md). The default, `routed`,
compiles blas_route.c once into the cache and loads it in front of a BLAS library: GEMMs of up
to KERNEL_ROWS token rows run on its own two-thread kernel (AVX2 or AVX-512, small_m.h), which
streams each weight row once for all tokens and gives every row the same bits whatever the
number of rows; the rest (prefill) runs on OpenBLAS or MKL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..settings import get as get_settings

ROUTED = "routed"
FAST_KINDS = (ROUTED, "mkl", "openblas")
CHOICES = ("auto", *FAST_KINDS, "off")
KERNEL_ROWS = 32  # routed: fp32 GEMMs with at most this many rows run on blas_route.c's kernel
NN_MAX_ELEMENTS = 1 << 20  # blas_route.c's NN_MAX: a non-transposed B up to this size stays on it
ROUTER_SOURCE = Path(__file__).with_name("blas_route.c")
ROUTER_DEPS = tuple(
    Path(__file__).with_name(n)
    for n in ("small_m.h", "blocks.h", "q8.h", "q8_avx512.h", "q8_kernel.h")
)
ROOFLINE_SOURCE = Path(__file__).with_name("roofline.c")
ISA_CODES = {"auto": 0, "avx2": 1, "avx512": 2}  # blas_route.c's adaspec_kernel_isa
FIX = (
    "install the 'mkl' or 'scipy-openblas32' wheel (or Debian's libopenblas0-pthread), and "
    "import adaspec before mlx; set ADASPEC_BLAS=off to silence this"
)


@dataclass(frozen=True)
class BlasStatus:
    requested: str
    kind: str  # routed | mkl | openblas | custom | reference | system | off
    library: str | None = None  # routed: "ROUTER_PATH + LIBRARY_PATH"
    warning: str | None = None  # set when mlx is left with a slow BLAS
    note: str | None = None  # why auto passed over a preferred choice

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
    dirs += [Path(d) for d in get_settings().ld_library_path.split(":") if d]
    for d in dirs:
        hits = sorted(glob.glob(str(d / "libmkl_rt.so*")))
        if hits:
            return hits[0]
    return ctypes.util.find_library("mkl_rt")


def find_openblas() -> str | None:
    """The scipy-openblas32 wheel's library (symbols prefixed scipy_), else a system OpenBLAS."""
    for p in _prefixes():
        hits = glob.glob(str(p / "lib/python3*/site-packages/scipy_openblas32/lib/*.so"))
        if hits:
            return sorted(hits)[0]
    for cand in (
        "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
        "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    ):
        if os.path.exists(cand):
            return cand
    return ctypes.util.find_library("openblas")


def symbol_prefix(path: str) -> str:
    """scipy-openblas builds prefix every symbol with scipy_ so they never clash."""
    return "scipy_" if "scipy_openblas" in os.path.basename(path) else ""


def loaded_fast_blas(maps: str = "/proc/self/maps") -> str | None:
    """Path of an optimized BLAS (or the router) already mapped into this process, if any."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return None
    found = None
    for line in text.splitlines():
        path = line.split()[-1] if line.split() else ""
        name = os.path.basename(path)
        if name.startswith("adaspec_blas_route"):
            return path
        if found is None and name.startswith(("libmkl_rt", "libopenblas")):
            found = path
    return found


def _kind_of_loaded(path: str) -> str:
    name = os.path.basename(path)
    if name.startswith("adaspec_blas_route"):
        return ROUTED
    return "mkl" if "mkl" in name else "openblas"


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> bytes:
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return b""
    return next((ln for ln in text.splitlines() if ln.startswith("flags")), "").encode()


def build_library(
    source: Path, cache: Path, compiler: str | None = None, deps: tuple[Path, ...] = ()
) -> Path:
    """Compile `source` (and the headers in `deps`) into `cache`/kernels once. It is built
    with -march=native, so the key is the sources' hash and this CPU's feature flags (a cache
    shared by other CPUs never hands one a binary built for another)."""
    text = b"".join(p.read_bytes() for p in (source, *deps))
    key = hashlib.sha256(text + _cpu_flags()).hexdigest()[:12]
    out = cache / "kernels" / f"adaspec_{source.stem}-{key}.so"
    if out.exists():
        return out
    cc = compiler or get_settings().cc or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError(f"no C compiler found to build {source.name} (set CC)")
    return compile_into(
        out, lambda tmp: [cc, "-O3", "-march=native", "-shared", "-fPIC", "-pthread", "-o",
                          str(tmp), str(source)],
    )  # fmt: skip


def compile_into(out: Path, command: Callable[[Path], list[str]], timeout: float = 600) -> Path:
    """Run the compiler `command(tmp)` gives (writing `tmp`), then move its output to `out`
    (several processes may build at once: each writes its own file, the last move wins)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = command(tmp)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        raise OSError(f"{cmd[0]} could not run: {exc} (command: {' '.join(cmd)})") from None
    if proc.returncode != 0:
        raise OSError(f"{cmd[0]} failed: {proc.stderr.strip()[-600:]} (command: {' '.join(cmd)})")
    os.replace(tmp, out)
    return out


def build_router(cache: Path, compiler: str | None = None) -> Path:
    return build_library(ROUTER_SOURCE, cache, compiler, ROUTER_DEPS)


_router: ctypes.CDLL | None = None
# OpenBLAS's idle threads poll 2**this cycles after a GEMM (default 28: ~60 ms, on the cores the
# decode steps after a prefill need; SmolLM2 AR 193-200 tok/s, 217-222 with 4)
OPENBLAS_THREAD_TIMEOUT = "4"


@contextmanager
def _short_blas_polls(library: str) -> Iterator[None]:
    """OPENBLAS_THREAD_TIMEOUT set while an OpenBLAS loads (it reads it then), unless set."""
    if "openblas" not in os.path.basename(library) or "OPENBLAS_THREAD_TIMEOUT" in os.environ:
        yield
        return
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = OPENBLAS_THREAD_TIMEOUT
    try:
        yield
    finally:
        del os.environ["OPENBLAS_THREAD_TIMEOUT"]


def route(library: str, cache: Path, kernel_rows: int = KERNEL_ROWS, isa: str = "auto") -> str:
    """Load `library` privately and the router globally: fp32 GEMMs with up to kernel_rows rows
    run on the router's kernels (instruction set `isa`), the rest (and every fp64 / complex
    GEMM) on `library`. Returns the router's path."""
    global _router
    router = build_router(cache)
    with _short_blas_polls(library):
        lib = ctypes.CDLL(library, mode=ctypes.RTLD_LOCAL)

    def fn(name: str) -> ctypes.c_void_p:
        try:
            return ctypes.cast(getattr(lib, symbol_prefix(library) + name), ctypes.c_void_p)
        except AttributeError:
            raise OSError(f"{library} has no {symbol_prefix(library) + name}") from None

    args = (fn("cblas_sgemm"), fn("cblas_dgemm"), fn("cblas_cgemm"))
    shim = ctypes.CDLL(str(router), mode=ctypes.RTLD_GLOBAL)
    if not shim.adaspec_blas_route(*args, ctypes.c_int(kernel_rows)):
        shim.adaspec_blas_route(*args, ctypes.c_int(0))  # built without AVX2/FMA: BLAS only
    elif shim.adaspec_kernel_isa(ISA_CODES[isa]) < 0:
        best = shim.adaspec_kernel_isa(0)
        warnings.warn(
            f"ADASPEC_KERNEL_ISA={isa}: this CPU cannot run it; using "
            f"{_ISA_NAMES.get(best, best)} (accepted here: auto, avx2"
            f"{', avx512' if best == ISA_CODES['avx512'] else ''})",
            RuntimeWarning,
            stacklevel=2,
        )
    _router = shim
    return str(router)


_ISA_NAMES = {code: name for name, code in ISA_CODES.items() if code}


def kernel_isa() -> str | None:
    """The instruction set of the router's kernel (avx2 | avx512), None without one."""
    if _router is None:
        return None
    return _ISA_NAMES.get(_router.adaspec_kernel_isa(-1))


def routed() -> bool:
    """Whether the router is loaded (fp32 GEMMs of up to KERNEL_ROWS rows run on its kernel)."""
    return _router is not None


def routed_calls() -> tuple[int, int] | None:
    """fp32 GEMM calls the router sent to its kernels and to the BLAS library; None if no
    router is loaded."""
    counts = _routed()
    return None if counts is None else (counts[0], counts[1])


def routed_seconds() -> tuple[float, float] | None:
    """Seconds spent so far in the GEMMs the router sent to its kernels and to the BLAS
    library (what part of a forward is matrix products); None if no router is loaded."""
    counts = _routed()
    return None if counts is None else (counts[2] / 1e9, counts[3] / 1e9)


def _routed() -> list[int] | None:
    if _router is None:
        return None
    out = (ctypes.c_ulong * 4)()
    _router.adaspec_blas_routed(out)
    return [int(v) for v in out]


class _Unavailable(Exception):
    pass


Finders = Mapping[str, Callable[[], str | None]]
DEFAULT_FINDERS: Finders = {"mkl": find_mkl, "openblas": find_openblas}
Loader = Callable[[str], object]
# loads a library behind the router with the kernel on up to N rows; returns the router's path
Router = Callable[[str, int], str]


def _load(kind: str, finders: Finders, loader: Loader, router: Router) -> str:
    """Load one fast kind; returns its library description. Raises _Unavailable when a
    library is not installed, OSError when one fails to load."""
    if kind == ROUTED:  # behind the kernel: OpenBLAS is the faster at prefill shapes
        path = finders["openblas"]() or finders["mkl"]()
        if not path:
            raise _Unavailable("neither openblas nor mkl found")
        return f"{router(path, KERNEL_ROWS)} + {path}"
    path = finders[kind]()
    if not path:
        raise _Unavailable("not found")
    if symbol_prefix(path):  # prefixed symbols: mlx can reach them only through the router
        router(path, 0)  # kernel off: every GEMM goes to the library
    else:
        with _short_blas_polls(path):
            loader(path)
    return path


def setup(
    requested: str = "auto",
    *,
    platform: str = sys.platform,
    modules: Iterable[str] = sys.modules,
    finders: Finders = DEFAULT_FINDERS,
    loader: Loader = lambda p: ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL),
    router: Router | None = None,
    cache: Path | None = None,
    already_loaded: Callable[[], str | None] = loaded_fast_blas,
    isa: str = "auto",
) -> BlasStatus:
    """Load the requested BLAS (auto: routed, then MKL, then OpenBLAS); never raises for a
    missing library."""
    if requested == "off":
        return BlasStatus(requested, "off")
    if not platform.startswith("linux"):
        return BlasStatus(requested, "system")
    present = already_loaded()
    if present:
        return BlasStatus(requested, _kind_of_loaded(present), present)
    if "mlx.core" in modules:
        return BlasStatus(
            requested,
            "reference",
            warning="mlx.core was imported before adaspec, so its "
            f"bundled reference BLAS (~20x slower) is in use; {FIX}",
        )
    if router is None:
        cache_dir = cache or get_settings().cache
        router = lambda path, rows: route(path, cache_dir, rows, isa)  # noqa: E731
    if requested in FAST_KINDS or requested == "auto":
        order = FAST_KINDS if requested == "auto" else (requested,)
        failures: list[str] = []
        for kind in order:
            try:
                library = _load(kind, finders, loader, router)
            except (_Unavailable, OSError) as exc:
                failures.append(f"{kind}: {exc}")
                continue
            return BlasStatus(requested, kind, library, note="; ".join(failures) or None)
        return BlasStatus(
            requested,
            "reference",
            warning=f"no optimized BLAS could be loaded for ADASPEC_BLAS={requested} "
            f"({'; '.join(failures)}); mlx uses its reference BLAS (~20x slower); {FIX}",
        )
    try:
        loader(requested)
    except OSError as exc:
        return BlasStatus(
            requested,
            "reference",
            warning=f"ADASPEC_BLAS={requested} could not be loaded ({exc}); accepted: "
            f"{', '.join(CHOICES)}, or a loadable library path",
        )
    return BlasStatus(requested, "custom", requested)


_status: BlasStatus | None = None


def ensure(requested: str | None = None) -> BlasStatus:
    """Run `setup` once per process (from ADASPEC_BLAS by default) and warn once if slow."""
    global _status
    if _status is None:
        settings = get_settings()
        _status = setup(requested or settings.blas, cache=settings.cache, isa=settings.kernel_isa)
        if _status.warning:
            warnings.warn(_status.warning, RuntimeWarning, stacklevel=3)
    return _status


def status() -> BlasStatus | None:
    return _status


def _thread_knob() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """The loaded library's (get, set) thread-count functions; None without a fast library."""
    if _status is None or _status.kind not in FAST_KINDS or not _status.library:
        return None
    path = _status.library.split(" + ")[-1]
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)  # already loaded: the same handle
    pre = symbol_prefix(path)
    for get, put in (
        (pre + "openblas_get_num_threads", pre + "openblas_set_num_threads"),
        ("MKL_Get_Max_Threads", "MKL_Set_Num_Threads"),
    ):
        if hasattr(lib, get) and hasattr(lib, put):
            return getattr(lib, get), getattr(lib, put)
    return None


@contextmanager
def library_threads(n: int) -> Iterator[None]:
    """The BLAS library (not the router's kernel) on n threads inside the block. One thread
    lets the caller run several GEMMs at once from its own threads; and on a busy machine a
    library's threads wait for each other at every GEMM (a 511-token SmolLM2 prefill took
    13.3 s on 2 OpenBLAS threads, 2.8 s on 1, beside another job on the 2 cores)."""
    knob = _thread_knob()
    if knob is None:
        yield
        return
    get, put = knob
    old = int(get())
    put(n)
    try:
        yield
    finally:
        put(old)
