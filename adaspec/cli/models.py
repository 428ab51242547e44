"""`adaspec models list | fetch NAME`: the offline catalogue of real models."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("models", help="list or fetch the offline model catalogue")
    verbs = p.add_subparsers(dest="verb", required=True)
    ls = verbs.add_parser("list", help="catalogue models, their size and whether they are here")
    ls.set_defaults(func=_list)
    fetch = verbs.add_parser("fetch", help="download and assemble a catalogue model (resumable)")
    fetch.add_argument("name", help="catalogue name, e.g. qwen2.5-coder-0.5b")
    fetch.set_defaults(func=_fetch)


def _list(args: argparse.Namespace) -> int:
    from ..targets import catalogue

    rows = catalogue.list()
    width = max(len(r.name) for r in rows)
    print(f"{'name':<{width}}  {'size':>8}  {'state':<12}  description")
    for r in rows:
        note = r.description + (" (default)" if r.name == catalogue.DEFAULT_MODEL else "")
        print(f"{r.name:<{width}}  {r.size / 1e6:>5.0f} MB  {r.state:<12}  {note}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from ..targets import catalogue

    print(catalogue.fetch(args.name))
    return 0
