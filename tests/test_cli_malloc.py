"""Tier 1: the command line restarts itself under glibc's larger per-thread cache."""

import os
import subprocess
import sys

import pytest

from adaspec.cli.malloc import TUNABLE, tuned_environment

PROBE = (
    "import os, sys; print(os.environ.get('GLIBC_TUNABLES'), flush=True); "
    "sys.argv = ['adaspec', 'models', 'list']; from adaspec.cli import main; main()"
)


def test_the_tunable_is_added_once_and_a_users_choice_is_kept():
    assert tuned_environment({}, 1000) == {"GLIBC_TUNABLES": f"{TUNABLE}=1000"}
    mine = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"}
    assert tuned_environment(mine, 64) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}=64",
        "X": "1",
    }
    assert tuned_environment({"GLIBC_TUNABLES": f"{TUNABLE}=7"}, 1000) is None
    assert tuned_environment({}, 0) is None


def run_probe(**env):
    full = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES",)}
    full.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [ln for ln in out.stdout.splitlines() if ln == "None" or "tcache" in ln]


@pytest.mark.skipif(sys.platform != "linux", reason="glibc tunables: Linux only")
def test_the_command_line_restarts_under_the_tuned_allocator():
    assert run_probe() == ["None", f"{TUNABLE}=1000"]  # printed before and after the restart
    assert run_probe(ADASPEC_MALLOC_TCACHE="0") == ["None"]
    assert run_probe(GLIBC_TUNABLES=f"{TUNABLE}=5") == [f"{TUNABLE}=5"]
