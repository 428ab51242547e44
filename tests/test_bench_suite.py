"""Tier 1: the prompt suite shipped with adaspec (package data), the loader's errors, and
`adaspec bench` taking it when no --suite is given (tier 2, a tiny target)."""

import json
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
from tiny import byte_tokenizer, save_tiny, tiny_model

from adaspec.bench import SHIPPED, load_suite
from adaspec.cli import main
from adaspec.errors import GenerationArgumentError

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_suite_has_grounded_and_open_categories():
    suite = load_suite()
    assert [p.id for p in suite] == [p.id for p in load_suite(SHIPPED)]
    assert len({p.id for p in suite}) == len(suite) >= 16
    grounded = {p.category for p in suite if p.grounded}
    open_ = {p.category for p in suite if not p.grounded}
    assert {"summarize", "extract", "code-edit", "repeat"} <= grounded
    assert {"story", "explain", "math", "code-gen"} <= open_
    assert not grounded & open_  # a category is one or the other
    for p in suite:
        assert p.messages and p.messages[-1]["role"] == "user" and p.messages[-1]["content"]
        assert 16 <= p.max_tokens <= 512


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_shipped_suite_is_package_data():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["adaspec"]
    rel = SHIPPED.relative_to(ROOT / "adaspec").as_posix()
    assert any(fnmatch(rel, pat) for pat in patterns), (rel, patterns)


def test_suite_errors_name_the_value(tmp_path):
    with pytest.raises(GenerationArgumentError, match="nowhere.jsonl' does not exist; accepted"):
        load_suite(tmp_path / "nowhere.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n')
    with pytest.raises(GenerationArgumentError, match=r"bad.jsonl:1 is not a prompt record"):
        load_suite(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(GenerationArgumentError, match="has no prompts"):
        load_suite(empty)


def test_cli_bench_defaults_to_the_shipped_suite(tmp_path):
    target = save_tiny(tiny_model("qwen3", seed=2), byte_tokenizer(), tmp_path / "target")
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(target), "--limit", "1", "--max-tokens", "4"]
    assert main([*argv, "--repeats", "1", "--ignore-chat-template", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["suite"] == str(SHIPPED)
    assert [r["id"] for r in res["records"]] == [load_suite()[0].id]
    assert res["records"][0]["identical"]


def test_no_cli_default_points_outside_the_project():
    from adaspec.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    outside = {
        (name, action.dest)
        for name, parser in sub.choices.items()
        for action in parser._actions
        if isinstance(action.default, str) and any(w in action.default for w in ("..", "shared"))
    }
    assert not outside
