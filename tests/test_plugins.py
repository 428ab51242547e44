"""Drafters from outside adaspec on the command line: --plugin MODULE or a .py path,
ADASPEC_PLUGINS, and an 'adaspec.drafters' entry point; the docs' example drafter passes
check_drafter; unknown drafters and broken plugins are refused saying how to register."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adaspec.drafters import plugins, registry
from adaspec.drafters.arms import make_arms
from adaspec.errors import DrafterError, PluginError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "bigram_drafter.py"
PROMPT = "the quick,brown"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from adaspec.testing import save_tiny, tiny_target, tiny_tokenizer

    return save_tiny(tiny_target(), tiny_tokenizer(), tmp_path_factory.mktemp("m") / "tiny")


def cli(folder, *args, env=None):
    base = ["generate", "--model", str(folder), "--prompt", PROMPT, "--max-tokens", "24"]
    run = subprocess.run(
        [sys.executable, "-m", "adaspec", *base, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    return run.returncode, run.stdout, run.stderr


def test_the_docs_example_is_short_and_passes_check_drafter():
    from adaspec.testing import check_drafter

    assert sum(1 for line in EXAMPLE.read_text().splitlines() if line.strip()) < 30
    assert EXAMPLE.read_text().strip() in (ROOT / "docs" / "testing.md").read_text()
    registry._FACTORIES.pop("bigram", None)
    plugins.load([str(EXAMPLE)])
    report = check_drafter(lambda: "bigram", examples=8, runs=400)
    assert report.accepted > 0 and report.sampled_accepted > 0


def test_plugin_flag_and_setting_run_the_drafter_on_the_cli(tiny_folder):
    code, ar, err = cli(tiny_folder, "--drafter", "none")
    assert code == 0, err
    code, out, err = cli(tiny_folder, "--plugin", str(EXAMPLE), "--drafter", "pld+bigram")
    assert code == 0, err
    assert out == ar and "accepted 0/" not in err
    code, out, err = cli(tiny_folder, "--drafter", "bigram", env={"ADASPEC_PLUGINS": str(EXAMPLE)})
    assert code == 0 and out == ar, err


def test_entry_point_route(tiny_folder, tmp_path):
    """A package declaring `bigram = "bigram_drafter:factory"` under [project.entry-points.
    "adaspec.drafters"]: installed (here: its dist-info on PYTHONPATH), no flag needed."""
    site = tmp_path / "site"
    (site / "bigram_drafter-0.1.dist-info").mkdir(parents=True)
    shutil.copy(EXAMPLE, site / "bigram_drafter.py")
    info = site / "bigram_drafter-0.1.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bigram-drafter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[adaspec.drafters]\nbigram = bigram_drafter:factory\n")
    code, ar, err = cli(tiny_folder, "--drafter", "none")
    code, out, err = cli(tiny_folder, "--drafter", "bigram", env={"PYTHONPATH": str(site)})
    assert code == 0 and out == ar, err
    assert "accepted 0/" not in err


def test_unknown_drafter_says_how_to_register(tiny_folder):
    with pytest.raises(DrafterError, match="unknown drafter 'nope'.*register_drafter.*--plugin"):
        make_arms("nope", None, None)
    code, _, err = cli(tiny_folder, "--drafter", "nope")
    assert code == 2 and "--plugin MODULE" in err and err.count("\n") == 1


def test_a_broken_plugin_is_refused_naming_it(tmp_path):
    bad = tmp_path / "bad_plugin.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(PluginError, match="plugin '.*bad_plugin.py' could not be imported .*boom"):
        plugins.load([str(bad)])
    with pytest.raises(PluginError, match="No module named 'no_such_plugin'"):
        plugins.load(["no_such_plugin"])


def test_every_subcommand_takes_plugin_flags_serve_included():
    from adaspec.cli import build_parser

    parser = build_parser()
    args, extra = parser.parse_known_args(["serve", "--plugin", "a.py", "--plugin", "b", "--x"])
    assert args.plugin == ["a.py", "b"] and extra == ["--x"]
    for argv in (
        ["generate", "--plugin", "m"],
        ["bench", "--plugin", "m"],
        ["doctor", "--plugin", "m"],
        ["models", "--plugin", "m", "list"],
        ["build-suffix", "--text", "t", "--out", "o", "--plugin", "m"],
    ):
        assert parser.parse_args(argv).plugin == ["m"]
