"""Tier 1: the package type-checks. `mypy adaspec` (the settings in pyproject.toml) reports no
errors."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_passes():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it comes with the [dev] extra)")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "adaspec"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"mypy adaspec reported errors:\n{run.stdout}{run.stderr}"
