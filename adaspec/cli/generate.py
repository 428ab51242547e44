"""`adaspec generate`: mlx_lm.generate's main flags plus --drafter and --compare-ar."""

from __future__ import annotations

import argparse
import sys

from .common import add_model_flags, drafter_plan, load_model, sampling_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text, speculating with a drafter")
    add_model_flags(p)
    p.add_argument("--prompt", "-p", default="hello", help="the user message (default 'hello')")
    p.add_argument("--system", default=None, help="system prompt for chat models")
    p.add_argument("--max-tokens", "-m", type=int, default=256, help="most tokens to generate")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--compare-ar",
        action="store_true",
        help="also run mlx-lm's plain AR; print speedup, tau, whether texts match, and a line "
        "per drafter (arm)",
    )
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="print effective settings and per-generation stats",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import settings as settings_mod
    from ..distributed import run_ranks

    settings = settings_mod.get()
    model, tokenizer = load_model(args.model)
    return run_ranks(model, tokenizer, settings.shard, lambda: _run(args, model, tokenizer))


def _run(args: argparse.Namespace, model, tokenizer) -> int:
    from .. import settings as settings_mod
    from ..api import stream_generate
    from ..bench.timing import timed
    from ..distributed.shard import sharding
    from ..prompting import messages_for, prompt_ids

    settings = settings_mod.get()
    ids = prompt_ids(
        tokenizer, messages_for(args.prompt, args.system), not args.ignore_chat_template
    )
    if args.verbose:
        for line in settings.describe():
            print(line, file=sys.stderr)
        shard = sharding(model)
        where = shard.describe() if shard else "one process"
        print(f"[adaspec] target: {where}", file=sys.stderr)
    kw = dict(
        drafter=drafter_plan(args, model, tokenizer),
        max_tokens=args.max_tokens,
        stop=args.stop,
        settings=settings,
        **sampling_kwargs(args),
    )
    texts: list[str] = []

    def printing(stream):
        for r in stream:
            texts.append(r.text)
            print(r.text, end="", flush=True)
            yield r

    spec = timed(printing(stream_generate(model, tokenizer, ids, **kw)))
    print()
    s = spec.stats
    print(
        f"[adaspec] {len(spec.tokens)} tokens, {spec.decode_tok_s:.1f} tok/s decode, "
        f"tau {s.get('tau', 0):.2f}, accepted {s.get('accepted', 0)}/{s.get('drafted', 0)}, "
        f"floored {s.get('floored_fraction', 0):.0%}",
        file=sys.stderr,
    )
    if args.verbose:
        from ..policy.stats import describe

        for line in describe(s).splitlines():
            print(f"[adaspec] {line}", file=sys.stderr)
    if args.compare_ar:
        _compare(model, tokenizer, ids, args, spec, "".join(texts))
    return 0


def _compare(model, tokenizer, ids, args, spec, spec_text: str) -> None:
    from ..bench.timing import timed
    from ..distributed.mirror import mirrored_ar

    texts: list[str] = []

    def collect(stream):
        for r in stream:
            texts.append(r.text)
            yield r

    # mlx-lm's own generate (on every rank when the model is sharded)
    ar = timed(collect(mirrored_ar(model, tokenizer, ids, args.max_tokens, sampling_kwargs(args))))
    same = ar.tokens == spec.tokens
    speed = spec.decode_tok_s / ar.decode_tok_s if ar.decode_tok_s else 0.0
    print(
        f"[compare-ar] AR {ar.decode_tok_s:.1f} tok/s, adaspec {spec.decode_tok_s:.1f} tok/s, "
        f"speedup {speed:.2f}x, tau {spec.stats.get('tau', 0):.2f}, identical: {same}"
        + (
            ""
            if same or args.temp == 0
            else " (expected at T>0: same distribution, different draws)"
        ),
        file=sys.stderr,
    )
    from ..policy.stats import arm_lines

    for line in arm_lines(spec.stats):
        print(f"[compare-ar] {line}", file=sys.stderr)
