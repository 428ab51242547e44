"""The BLAS loader, simulated: which library it picks, when it warns, and when it does nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from adaspec.kernels import blas

MKL = "/env/lib/libmkl_rt.so.3"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
WHEEL = "/env/lib/python3.11/site-packages/scipy_openblas32/lib/libscipy_openblas.so"
ROUTER = "/cache/kernels/adaspec_blas_route-0.so"


def run(requested="auto", *, mkl=MKL, openblas=OPENBLAS, modules=(), platform="linux",
        already=None, broken=(), no_compiler=False):  # fmt: skip
    """-> status, libraries loaded globally, (library, kernel rows) put behind the router"""
    loaded, routed = [], []

    def loader(path):
        if path in broken:
            raise OSError(f"cannot open {path}")
        loaded.append(path)

    def router(path, rows):
        if no_compiler:
            raise OSError("no C compiler found to build the BLAS router (set CC)")
        if path in broken:
            raise OSError(f"cannot open {path}")
        routed.append((path, rows))
        return ROUTER

    status = blas.setup(
        requested,
        platform=platform,
        modules=modules,
        finders={"mkl": lambda: mkl, "openblas": lambda: openblas},
        loader=loader,
        router=router,
        already_loaded=lambda: already,
    )
    return status, loaded, routed


def test_auto_prefers_the_kernel_in_front_of_openblas():
    status, loaded, routed = run()
    assert (status.kind, loaded, routed) == ("routed", [], [(OPENBLAS, blas.KERNEL_ROWS)])
    assert status.library == f"{ROUTER} + {OPENBLAS}"
    assert status.fast and status.warning is None and status.note is None


def test_routed_uses_mkl_when_openblas_is_missing():
    status, _, routed = run(openblas=None)
    assert (status.kind, routed) == ("routed", [(MKL, blas.KERNEL_ROWS)])


def test_without_a_compiler_auto_falls_back_to_mkl_and_says_why():
    status, loaded, routed = run(no_compiler=True)
    assert (status.kind, loaded, routed) == ("mkl", [MKL], [])
    assert status.warning is None and "no C compiler" in status.note


def test_auto_falls_back_to_openblas():
    status, loaded, _ = run(mkl=None, no_compiler=True)
    assert (status.kind, loaded) == ("openblas", [OPENBLAS])
    assert status.warning is None


def test_the_prefixed_wheel_openblas_is_reached_through_the_router_with_the_kernel_off():
    status, loaded, routed = run("openblas", openblas=WHEEL)
    assert (status.kind, loaded, routed) == ("openblas", [], [(WHEEL, 0)])
    assert blas.symbol_prefix(WHEEL) == "scipy_" and blas.symbol_prefix(OPENBLAS) == ""


def test_auto_skips_a_library_that_fails_to_load():
    status, loaded, _ = run(broken=(MKL,), no_compiler=True)
    assert (status.kind, loaded) == ("openblas", [OPENBLAS])
    assert "cannot open" in status.note


def test_warns_when_no_fast_blas_exists():
    status, loaded, routed = run(mkl=None, openblas=None)
    assert status.kind == "reference" and not status.fast and (loaded, routed) == ([], [])
    assert "no optimized BLAS" in status.warning and "scipy-openblas32" in status.warning


def test_warns_with_the_failure_when_every_candidate_breaks():
    status, _, _ = run(broken=(MKL, OPENBLAS))
    assert status.kind == "reference" and "cannot open" in status.warning


def test_explicit_choice_is_honoured():
    status, loaded, _ = run("openblas")
    assert (status.kind, loaded) == ("openblas", [OPENBLAS])
    status, loaded, _ = run("mkl", mkl=None)
    assert status.kind == "reference" and loaded == [] and "ADASPEC_BLAS=mkl" in status.warning
    status, _, _ = run("routed", no_compiler=True)
    assert status.kind == "reference" and "no C compiler" in status.warning


def test_custom_path():
    status, loaded, _ = run("/opt/blas/libcustom.so")
    assert (status.kind, loaded) == ("custom", ["/opt/blas/libcustom.so"])
    status, _, _ = run("/opt/blas/libcustom.so", broken=("/opt/blas/libcustom.so",))
    assert status.kind == "reference" and "could not be loaded" in status.warning


def test_off_disables_everything():
    status, loaded, routed = run("off")
    assert (status.kind, loaded, routed, status.warning) == ("off", [], [], None)


@pytest.mark.parametrize("platform", ["darwin", "win32"])
def test_no_effect_off_linux(platform):
    status, loaded, _ = run(platform=platform, modules=("mlx.core",))
    assert (status.kind, loaded, status.warning) == ("system", [], None)


def test_warns_when_mlx_was_imported_first():
    status, loaded, routed = run(modules=("mlx.core",))
    assert status.kind == "reference" and loaded == routed == []
    assert "imported before adaspec" in status.warning


def test_already_loaded_library_is_reported_not_reloaded():
    status, loaded, _ = run(modules=("mlx.core",), already="/x/libopenblas.so.0")
    assert (status.kind, status.library, loaded) == ("openblas", "/x/libopenblas.so.0", [])
    status, _, _ = run(modules=("mlx.core",), already="/c/kernels/adaspec_blas_route-1.so")
    assert status.kind == "routed"


def test_loaded_fast_blas_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        f"7f02-7f03 r-xp 00000000 08:01 2 {MKL}\n"
    )
    assert blas.loaded_fast_blas(str(maps)) == MKL
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert blas.loaded_fast_blas(str(maps)) is None
    assert blas.loaded_fast_blas(str(tmp_path / "absent")) is None


def _fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    # no preloaded library: the process maps only what `code` loads
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith("ADASPEC_") and k != "LD_PRELOAD"
    }
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True, text=True, check=True, env={**environ, **env},
    )  # fmt: skip


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="BLAS loading is Linux-only")
@pytest.mark.parametrize("requested", ["auto", *blas.FAST_KINDS])
def test_real_process_mlx_first_warns_once(requested):
    out = _fresh(
        "import mlx.core, adaspec; print(adaspec._blas.status().kind)", ADASPEC_BLAS=requested
    )
    assert out.stdout.strip() == "reference"
    assert out.stderr.count("RuntimeWarning") == out.stderr.count("imported before adaspec") == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="BLAS loading is Linux-only")
@pytest.mark.parametrize("kind", ["mkl", "openblas"])
def test_real_process_a_blas_loaded_before_mlx_is_reported_without_a_warning(kind):
    path = blas.DEFAULT_FINDERS[kind]()
    if not path or blas.symbol_prefix(path):  # prefixed symbols: mlx could not use it
        pytest.skip(f"no {kind} library that mlx could use is installed")
    code = (
        f"import ctypes; ctypes.CDLL({path!r}, mode=ctypes.RTLD_GLOBAL); "
        "import mlx.core, adaspec; print(adaspec._blas.status().kind)"
    )
    out = _fresh(code)
    assert out.stdout.strip() == kind and "RuntimeWarning" not in out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="BLAS loading is Linux-only")
def test_real_process_off():
    out = _fresh("import adaspec; print(adaspec._blas.status().kind)", ADASPEC_BLAS="off")
    assert out.stdout.strip() == "off" and "RuntimeWarning" not in out.stderr


def test_library_threads_sets_the_loaded_library_and_restores_it():
    import adaspec  # noqa: F401  (loads the BLAS)

    knob = blas._thread_knob()
    if knob is None:
        pytest.skip(f"no thread knob for BLAS {blas.status()}")
    get, _ = knob
    before = get()
    with blas.library_threads(1):
        assert get() == 1
    assert get() == before


def _timeout_seen_by_loader(monkeypatch, path, user=None):
    """-> the OPENBLAS_THREAD_TIMEOUT a loader of `path` sees, and the variable after it"""
    if user is None:
        monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", user)
    seen = []
    blas._load(
        "openblas",
        {"openblas": lambda: path},
        lambda p: seen.append(os.environ.get("OPENBLAS_THREAD_TIMEOUT")),
        lambda p, r: "",
    )
    return seen[0] if seen else None, os.environ.get("OPENBLAS_THREAD_TIMEOUT")


def test_openblas_loads_with_short_thread_polls_and_the_environment_is_left_as_it_was(monkeypatch):
    assert _timeout_seen_by_loader(monkeypatch, OPENBLAS) == (blas.OPENBLAS_THREAD_TIMEOUT, None)


def test_a_thread_timeout_the_user_set_wins(monkeypatch):
    assert _timeout_seen_by_loader(monkeypatch, OPENBLAS, user="20") == ("20", "20")


def test_another_library_loads_without_the_variable(monkeypatch):
    assert _timeout_seen_by_loader(monkeypatch, "/env/lib/libblis.so") == (None, None)


def test_real_process_leaves_no_thread_timeout_for_children():
    """The variable is set only while the routed library's OpenBLAS loads: a child process
    (the stock mlx-lm peer) sees the environment the user gave."""
    code = (
        "import os, adaspec, mlx.core as mx; from adaspec.kernels import blas; "
        "print(blas.status().kind, os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    )
    out = _fresh(code)
    kind, env = out.stdout.split()
    if kind not in ("routed", "openblas"):
        pytest.skip(f"no OpenBLAS here ({kind})")
    assert env == "None"
