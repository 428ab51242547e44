"""`adaspec bench`: AR (mlx-lm) vs adaspec per prompt of a suite, interleaved, medians."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import add_model_flags, drafter_spec, load_model, sampling_kwargs

DEFAULT_SUITE = Path("..") / "shared" / "prompts" / "dev.jsonl"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark adaspec against mlx-lm AR on a prompt suite")
    add_model_flags(p)
    p.add_argument("--suite", default=str(DEFAULT_SUITE), help="JSONL prompt suite")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and side")
    p.add_argument("--max-tokens", type=int, default=None, help="override each prompt's")
    p.add_argument("--category", action="append", default=[], help="only these categories")
    p.add_argument(
        "--grounded",
        choices=["yes", "no"],
        default=None,
        help="only grounded (yes) or open (no) prompts",
    )
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--json", default=None, help="write records + summary here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench import load_suite, markdown, run_suite, save
    from ..errors import GenerationArgumentError

    if args.repeats < 1:
        raise GenerationArgumentError(f"--repeats={args.repeats} is invalid; accepted: >= 1")
    suite = load_suite(args.suite)
    if args.category:
        suite = [p for p in suite if p.category in args.category]
    if args.grounded:
        suite = [p for p in suite if p.grounded == (args.grounded == "yes")]
    suite = suite[: args.limit]
    if not suite:
        raise GenerationArgumentError("no prompts left after --category/--grounded/--limit")
    model, tokenizer = load_model(args.model)
    result = run_suite(
        model,
        tokenizer,
        suite,
        drafter=drafter_spec(args, model, tokenizer),
        repeats=args.repeats,
        max_tokens=args.max_tokens,
        spec_kwargs=sampling_kwargs(args),
        use_template=not args.ignore_chat_template,
    )
    result["config"].update(model=args.model, suite=args.suite)
    print(markdown(result["records"], result["summary"]))
    if args.json:
        save(result, args.json)
    return 0
