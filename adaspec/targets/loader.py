"""Load a model by mlx-lm folder / Hugging Face id, GGUF file or catalogue name.

GGUF files are converted once into a verified cache entry (`<ADASPEC_CACHE>/models/<key>/`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from ..settings import Settings
from ..settings import get as get_settings
from . import catalogue

log = logging.getLogger(__name__)

# Bump when the conversion output changes, so old cache entries are not reused.
CONVERTER_VERSION = 1
MANIFEST = "adaspec-manifest.json"
DEFAULT_DTYPE = "float32"  # bf16/fp16 matmuls skip BLAS on CPU


def load(
    path_or_name: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    settings: Settings | None = None,
) -> tuple[Any, Any]:
    """(model, TokenizerWrapper) for an mlx-lm folder / HF id, a .gguf file or a catalogue name,
    on the CPU fast paths; not warmed up (`adaspec.load`, api.load, also warms it up)."""
    import mlx_lm

    from . import stored_model

    settings = settings or get_settings()
    if dtype in (None, DEFAULT_DTYPE) and stored_model.enabled(settings):
        source = gguf_source(path_or_name, settings)
        if source is not None:
            src, sha = source
            entry = converted(src, settings=settings, sha256=sha, stored=True)
            return _fast(*stored_model.load(entry, src), settings)
    target, from_gguf = resolve(path_or_name, dtype=dtype, settings=settings)
    try:
        # mlx-lm types load() as a pair or a triple; without return_config it is the pair
        model, tokenizer = mlx_lm.load(target)  # type: ignore[misc]
    except Exception as exc:  # hub, missing weights, unknown model_type: one error type
        raise ModelLoadError(f"mlx_lm could not load {target!r}: {exc}") from exc
    if dtype is not None and not from_gguf:
        import mlx.core as mx

        from .gguf import check_dtype

        model.set_dtype(getattr(mx, check_dtype(dtype)))
    elif dtype is None and not from_gguf and stored_model.enabled(settings):
        stored_model.from_halves(model)  # bf16 / fp16 weights read as stored, fp32 compute
    return _fast(model, tokenizer, settings)


def _fast(model: Any, tokenizer: Any, settings: Settings) -> tuple[Any, Any]:
    """The model on the CPU fast paths (kernels/fast_ops.py, stock mlx's bits), so that
    mlx-lm's own generation on it runs them too."""
    from ..kernels import fast_ops

    fast_ops.install(model)
    if settings.arithmetic != "exact":
        from ..kernels import arithmetic

        arithmetic.apply(model, settings.arithmetic)
    return model, tokenizer


def resolve(
    path_or_name: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    settings: Settings | None = None,
    progress: bool = True,
) -> tuple[str, bool]:
    """(what to pass to mlx_lm.load, whether it is a GGUF conversion); converts if needed."""
    settings = settings or get_settings()
    source = gguf_source(path_or_name, settings)
    if source is not None:
        src, sha = source
        return str(
            converted(src, dtype=dtype, settings=settings, sha256=sha, progress=progress)
        ), True
    name = os.fspath(path_or_name)
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{name!r} is a folder without config.json, not an mlx-lm model")
        return str(p), False
    if p.exists():
        raise ModelLoadError(f"{name!r} is neither a GGUF file nor an mlx-lm model folder")
    if _looks_like_hf_id(name):
        return name, False
    raise ModelLoadError(
        f"model {name!r} not found; accepted: an existing .gguf file or mlx-lm folder, a Hugging "
        f"Face id (org/name), or a catalogue name ({', '.join(catalogue.ENTRIES)})"
    )


def gguf_source(
    path_or_name: str | os.PathLike[str], settings: Settings
) -> tuple[Path, str | None] | None:
    """(GGUF file, its known sha256) for a catalogue name or a .gguf path; None otherwise."""
    name = os.fspath(path_or_name)
    if name in catalogue.ENTRIES:
        return catalogue.require(name, settings), catalogue.entry(name).sha256
    p = Path(name).expanduser()
    if p.suffix.lower() == ".gguf" or (p.is_file() and _is_gguf(p)):
        return p, None
    return None


def _is_gguf(p: Path) -> bool:
    from .gguf import MAGIC

    with open(p, "rb") as f:
        return f.read(4) == MAGIC


def _looks_like_hf_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def cache_key(src: Path, dtype: str, sha256: str | None = None) -> str:
    """Entry name: file stem, dtype ("stored" for a stored entry) and a hash of the file's
    identity (content hash if known)."""
    if sha256 is None:
        st = src.stat()
        sha256 = f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    ident = hashlib.sha256(f"{sha256}|{dtype}|v{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    return f"{src.stem}-{dtype}-{ident}"


def converted(
    src: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    settings: Settings | None = None,
    sha256: str | None = None,
    progress: bool = True,
    stored: bool = False,
) -> Path:
    """The cache folder holding GGUF `src` converted to `dtype` (with `stored`, its stored
    matrices left in the GGUF file), building it if absent or bad."""
    from .gguf import check_dtype, check_file

    dtype = check_dtype(dtype or DEFAULT_DTYPE)
    src = Path(src).expanduser()
    check_file(src)  # missing / not GGUF: fail before touching the cache
    root = (settings or get_settings()).cache / "models"
    entry = root / cache_key(src, "stored" if stored else dtype, sha256)
    problem = verify_entry(entry)
    if problem is None:
        log.info("using cached conversion %s", entry)
        return entry
    if entry.exists():
        log.warning("cache entry %s is unusable (%s); rebuilding it", entry, problem)
    if sha256 is not None:
        _check_sha256(src, sha256)
    return _build(src, entry, dtype, progress, stored)


def _check_sha256(src: Path, expected: str) -> None:
    got = catalogue.sha256_file(src)
    if got != expected:
        raise ModelLoadError(f"{src} has sha256 {got}, expected {expected}; the file is corrupt")


def _build(src: Path, entry: Path, dtype: str, progress: bool, stored: bool = False) -> Path:
    from .gguf import convert

    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(entry)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.{os.getpid()}.", dir=entry.parent))
    try:
        convert(src, tmp, dtype=dtype, progress=progress, stored=stored)
        _write_manifest(tmp, src, dtype)
        # Another process may have finished the same entry meanwhile: keep theirs.
        if verify_entry(entry) is not None:
            shutil.rmtree(entry, ignore_errors=True)
            os.rename(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s into %s", src, entry)
    return entry


def _remove_stale_temps(entry: Path) -> None:
    """Delete temp dirs of conversions whose process died (they hold up to GBs)."""
    for tmp in entry.parent.glob(f".{entry.name}.*"):
        pid = tmp.name[len(entry.name) + 2 :].split(".", 1)[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


def _write_manifest(folder: Path, src: Path, dtype: str) -> None:
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file():
            st = p.stat()
            digest = catalogue.sha256_file(p)
            files[p.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    manifest = {
        "converter_version": CONVERTER_VERSION,
        "source": str(src.resolve()),
        "dtype": dtype,
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def verify_entry(entry: Path, *, full: bool = False) -> str | None:
    """None if cache entry `entry` is complete and matches its manifest, else the problem.

    A file whose size and mtime are as written is trusted; any file touched since (or every
    file, with `full`) is re-hashed, so a warm load of a 6 GB entry costs a stat, not a read.
    """
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return "no manifest" if entry.exists() else "absent"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest: {exc}"
    if manifest.get("converter_version") != CONVERTER_VERSION:
        return "made by another converter version"
    touched = []
    for name, want in files.items():
        p = entry / name
        if not p.is_file():
            return f"{name} is missing"
        st = p.stat()
        if st.st_size != want["size"]:
            return f"{name} is {st.st_size} bytes, manifest says {want['size']}"
        if full or st.st_mtime_ns != want.get("mtime_ns"):
            touched.append(name)
    for name in touched:
        if catalogue.sha256_file(entry / name) != files[name]["sha256"]:
            return f"{name} does not match its sha256"
    return None
