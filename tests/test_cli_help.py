"""Every --help shows each option's default; `serve --help` names the mlx_lm flags it refuses."""

import argparse
import re

import pytest

from adaspec.cli import build_parser
from adaspec.cli import serve as serve_cli


def _parsers():
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    yield "adaspec", top
    for name, p in sub.choices.items():
        if name != "serve":  # its own parser below (mlx_lm.server's flags)
            yield name, p
    yield "serve", serve_cli.build_parser()


def _entries(text: str) -> list[str]:
    """The help text of each option: its line and the indented lines that continue it."""
    return re.split(r"\n(?=  -)", " ".join(text.split("\n\n")))


@pytest.mark.parametrize("name, parser", list(_parsers()), ids=lambda x: str(x)[:20])
def test_every_option_with_a_default_shows_it(name, parser):
    entries = _entries(parser.format_help())
    missing = []
    for a in parser._actions:
        if not a.option_strings or a.help == argparse.SUPPRESS:
            continue
        if a.default in (None, False, argparse.SUPPRESS) or a.default == []:
            continue
        entry = next(e for e in entries if e.strip().startswith(a.option_strings[0]))
        if "default" not in entry.lower():
            missing.append(a.option_strings[0])
    assert not missing, f"{name}: options whose help hides the default: {missing}"


def test_serve_help_names_the_refused_mlx_lm_flags():
    text = " ".join(serve_cli.build_parser().format_help().split())
    for flag in serve_cli.NOT_READ:
        assert f"--{flag.replace('_', '-')}" in text.split("Refused unless left at their")[1]
    assert text.count("[refused by adaspec serve unless left at default]") == len(
        serve_cli.NOT_READ
    )
