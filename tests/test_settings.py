"""adaspec.settings: every environment variable adaspec reads, read once and validated."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from adaspec import settings as settings_mod
from adaspec.errors import SettingsError
from adaspec.kernels import blas
from adaspec.settings import HOST, PREFIX, Settings, from_env


def test_unknown_names_are_all_named_with_the_closest_knob():
    env = {"ADASPEC_GATE_MARGN": "1.2", "ADASPEC_NOPE": "1", "ADASPEC_GATE": "off"}
    with pytest.raises(SettingsError) as exc:
        from_env(env)
    msg = str(exc.value)
    assert msg.startswith("unknown environment variables ADASPEC_GATE_MARGN='1.2' ")
    assert "(did you mean ADASPEC_GATE_MARGIN" in msg and "ADASPEC_NOPE='1'" in msg
    assert msg.endswith("known: " + ", ".join(Settings().as_env()))


def test_unknown_names_are_refused_in_any_case():
    with pytest.raises(SettingsError, match="unknown environment variable adaspec_nope='1'"):
        from_env({"adaspec_nope": "1"})


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"ADASPEC_PROBE_LIFT": "maybe"},
            "ADASPEC_PROBE_LIFT='maybe' is invalid; accepted: true, false, 1, 0, yes, no, on, off",
        ),
        (
            {"ADASPEC_PREFILL_STEP": "0"},
            "ADASPEC_PREFILL_STEP='0' is invalid: Input should be greater than or equal to 1",
        ),
        (
            {"ADASPEC_ROLLBACK": "undo"},
            "ADASPEC_ROLLBACK='undo' is invalid; accepted: auto, delta, ssm, layers, refeed",
        ),
        (
            {"ADASPEC_KERNEL_ISA": "sse"},
            "ADASPEC_KERNEL_ISA='sse' is invalid; accepted: auto, avx512, avx2",
        ),
        (
            {"ADASPEC_DRAFT_MODEL_WEIGHTS": "int8"},
            "ADASPEC_DRAFT_MODEL_WEIGHTS='int8' is invalid; accepted: auto, fp32, bf16, q8, q4",
        ),
    ],
)
def test_a_bad_value_names_the_variable_its_value_and_what_is_accepted(env, message):
    with pytest.raises(SettingsError) as exc:
        from_env(env)
    assert str(exc.value) == message  # whole message: no second error about the cache default


def test_every_bad_value_is_reported_at_once():
    with pytest.raises(SettingsError) as exc:
        from_env({"ADASPEC_PLD_DRAFT_LEN": "0", "ADASPEC_GATE": "maybe"})
    assert "ADASPEC_PLD_DRAFT_LEN='0'" in str(exc.value) and "ADASPEC_GATE='maybe'" in str(
        exc.value
    )


def test_keywords_override_the_environment_and_none_means_not_given():
    s = from_env({"ADASPEC_GATE": "entropy", "ADASPEC_DRAFT_MAX": "8"}, gate="off", draft_max=None)
    assert (s.gate, s.draft_max) == ("off", 8)
    with pytest.raises(SettingsError, match="unknown setting gates='off'; known: .*gate"):
        from_env({}, gates="off")
    with pytest.raises(SettingsError, match="ADASPEC_GATE='bad' is invalid"):
        from_env({}, gate="bad")


def test_an_explicit_mapping_is_the_whole_environment(monkeypatch):
    monkeypatch.setenv("ADASPEC_GATE", "nonsense")
    monkeypatch.setenv("XDG_CACHE_HOME", "/elsewhere")
    monkeypatch.setenv("CC", "/elsewhere/cc")
    s = from_env({})
    assert s == Settings.model_construct()  # every default; nothing from os.environ
    assert s.cache == Path.home() / ".cache" / "adaspec" and s.cc is None


def test_host_variables_are_read_under_their_own_names():
    s = from_env({"XDG_CACHE_HOME": "/xdg", "CC": "clang", "LD_LIBRARY_PATH": "/a:/b"})
    assert (s.cache, s.cc, s.ld_library_path) == (Path("/xdg/adaspec"), "clang", "/a:/b")
    assert from_env({"XDG_CACHE_HOME": "/xdg", "ADASPEC_CACHE": "/c"}).cache == Path("/c")
    assert not set(HOST.values()) & set(s.as_env())  # -v and doctor print the ADASPEC_ knobs


def test_as_env_prints_every_knob_under_its_variable():
    s = from_env({"ADASPEC_GATE": "both", "ADASPEC_DRAFT_ADAPTIVE": "0"})
    env = s.as_env()
    assert list(env) == [PREFIX + f.upper() for f in Settings.model_fields if f not in HOST]
    assert (env["ADASPEC_GATE"], env["ADASPEC_DRAFT_ADAPTIVE"]) == ("both", "False")
    assert from_env(env) == s  # what is printed reads back as the same settings


def test_settings_are_frozen_and_read_once(monkeypatch):
    monkeypatch.setenv("ADASPEC_GATE", "entropy")
    settings_mod.get.cache_clear()
    try:
        first = settings_mod.get()
        monkeypatch.setenv("ADASPEC_GATE", "off")
        assert settings_mod.get() is first and first.gate == "entropy"
        with pytest.raises(pydantic.ValidationError):
            first.gate = "off"
    finally:
        settings_mod.get.cache_clear()


def test_direct_construction_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("ADASPEC_DRAFT_MIN", "3")
    assert Settings().draft_min == 3
    monkeypatch.setenv("ADASPEC_DRAFT_MIN", "17")  # above ADASPEC_DRAFT_MAX=16
    with pytest.raises(SettingsError, match="ADASPEC_DRAFT_MIN=17 is larger than"):
        Settings()


def test_no_dotenv_file_is_read(tmp_path, monkeypatch):
    (tmp_path / ".env").write_text("ADASPEC_GATE=off\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ADASPEC_GATE", raising=False)
    assert Settings().gate == "commit"


def test_the_blas_loader_reads_cc_and_ld_library_path_from_settings(tmp_path, monkeypatch):
    (tmp_path / "libmkl_rt.so.2").touch()
    env = {"CC": str(tmp_path / "no-such-cc"), "LD_LIBRARY_PATH": f"/nowhere:{tmp_path}"}
    monkeypatch.setattr(blas, "get_settings", lambda: from_env(env))
    monkeypatch.setattr(blas, "_prefixes", lambda: [])
    assert blas.find_mkl() == str(tmp_path / "libmkl_rt.so.2")
    with pytest.raises(OSError, match="no-such-cc"):
        blas.build_library(blas.ROUTER_SOURCE, tmp_path / "cache")


@pytest.mark.parametrize(
    "env, message",
    [
        ({"ADASPEC_GATE": "maybe"}, "SettingsError: ADASPEC_GATE='maybe' is invalid"),
        ({"ADASPEC_GATEE": "off"}, "SettingsError: unknown environment variable ADASPEC_GATEE"),
    ],
)
def test_a_bad_environment_fails_at_the_first_use_and_in_one_line_on_the_cli(env, message):
    """`import adaspec` stays silent; the first call that reads the settings raises
    SettingsError; the CLI prints the error in one line on stderr and exits with 2."""
    import os

    environ = {**{k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}, **env}
    code = (
        "import adaspec, adaspec.settings as s\n"
        "try:\n    s.get()\nexcept Exception as e:\n    print(type(e).__name__ + ': ' + str(e))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ)
    assert out.returncode == 0 and message in out.stdout and "adaspec" not in out.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "adaspec", "models", "list"],
        capture_output=True, text=True, env=environ,
    )  # fmt: skip
    assert cli.returncode == 2 and cli.stderr.count("\n") == 1 and cli.stdout == ""
    assert message.removeprefix("SettingsError: ") in cli.stderr


def test_a_misspelt_name_suggests_the_close_ones_without_listing_all():
    with pytest.raises(SettingsError) as e:
        from_env({"ADASPEC_GATE_MARGN": "2"})
    msg = str(e.value)
    assert "ADASPEC_GATE_MARGN='2' (did you mean ADASPEC_GATE_MARGIN" in msg
    assert "ADASPEC_BLAS" not in msg and "README" in msg
    with pytest.raises(SettingsError, match="known: ADASPEC_BLAS, .*ADASPEC_GATE"):
        from_env({"ADASPEC_ZZZZZZ": "1"})  # nothing close: every name listed


@pytest.mark.parametrize("name", ["adaspec_gate", "Adaspec_Gate", "ADASPEC_gate"])
def test_names_are_upper_case_and_other_cases_are_refused(name):
    with pytest.raises(
        SettingsError, match=f"{name}='off' \\(names are upper case: ADASPEC_GATE\\)"
    ):
        from_env({name: "off"})


def test_host_variables_are_read_by_their_exact_name(tmp_path):
    assert from_env({"XDG_CACHE_HOME": str(tmp_path)}).cache == tmp_path / "adaspec"
    assert from_env({"xdg_cache_home": str(tmp_path)}).cache != tmp_path / "adaspec"


def test_settings_that_differ_from_the_defaults_are_marked(tmp_path):
    s = from_env(
        {"ADASPEC_GATE": "off", "ADASPEC_DRAFT_MAX": "16", "XDG_CACHE_HOME": str(tmp_path)}
    )
    assert s.changed() == {"ADASPEC_GATE": "commit"}  # 16 is the default; the cache follows XDG
    lines = s.describe()
    assert "ADASPEC_GATE=off  (default commit)" in lines and "ADASPEC_DRAFT_MAX=16" in lines
    assert len(lines) == len(s.as_env())
    assert (
        from_env({"ADASPEC_PLUGINS": "x"}).describe().count("ADASPEC_PLUGINS=x  (default (none))")
        == 1
    )
