"""`adaspec generate`: mlx_lm.generate's main flags plus --drafter, --compare-ar and
--compare-stock."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from typing import Any

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
        "--compare-stock",
        action="store_true",
        help="also run stock mlx-lm in a process that never imports adaspec (the mlx wheel's "
        "own BLAS and kernels, the model's fp32 expansion); print its rate, adaspec's ratio to "
        "it and whether the tokens match",
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


def _run(args: argparse.Namespace, model: Any, tokenizer: Any) -> int:
    from .. import settings as settings_mod
    from ..api import stream_generate
    from ..bench.timing import timed
    from ..distributed.shard import sharding
    from ..errors import GenerationArgumentError
    from ..kernels import arithmetic
    from ..prompting import messages_for, prompt_ids

    settings = settings_mod.get()
    if args.compare_stock and sharding(model) is not None:
        raise GenerationArgumentError(
            "--compare-stock runs stock mlx-lm on the whole model in one process; accepted on "
            "a sharded target: no --compare-stock"
        )
    ids = prompt_ids(
        tokenizer, messages_for(args.prompt, args.system), not args.ignore_chat_template
    )
    if args.verbose:
        for line in settings.describe():
            print(line, file=sys.stderr)
        shard = sharding(model)
        where = shard.describe() if shard else "one process"
        print(
            f"[adaspec] target: {where}, arithmetic {arithmetic.describe(model)}", file=sys.stderr
        )
    kw = dict(
        drafter=drafter_plan(args, model, tokenizer),
        max_tokens=args.max_tokens,
        stop=args.stop,
        settings=settings,
        **sampling_kwargs(args),
    )

    def printing(stream: Iterable[Any]) -> Iterator[Any]:
        for r in stream:
            print(r.text, end="", flush=True)
            yield r

    if args.compare_ar or args.compare_stock:
        _warm(model, tokenizer, args, kw)
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
        from ..loop.stats import describe

        for line in describe(s).splitlines():
            print(f"[adaspec] {line}", file=sys.stderr)
    if args.compare_ar:
        _compare(model, tokenizer, ids, args, spec)
    if args.compare_stock:
        _compare_stock(tokenizer, ids, args, spec)
    return 0


def _warm(model: Any, tokenizer: Any, args: argparse.Namespace, kw: dict) -> None:
    """Before anything is timed: adaspec with the same drafter and sampler, and mlx-lm's AR
    when it is compared, each once on another prompt (warmup.py)."""
    from ..api import stream_generate
    from ..bench.timing import timed
    from ..distributed.mirror import mirrored_ar
    from ..warmup import warm_generations, warm_ids

    def spec(ids: list[int], n: int) -> Any:
        return timed(stream_generate(model, tokenizer, ids, **{**kw, "max_tokens": n}))

    def ar(ids: list[int], n: int) -> Any:
        return timed(mirrored_ar(model, tokenizer, ids, n, sampling_kwargs(args)))

    runners = [spec, ar] if args.compare_ar else [spec]
    warm_generations(runners, warm_ids(tokenizer, not args.ignore_chat_template))


def _compare(
    model: Any, tokenizer: Any, ids: list[int], args: argparse.Namespace, spec: Any
) -> None:
    from ..bench.timing import timed
    from ..distributed.mirror import mirrored_ar

    # mlx-lm's own generate (on every rank when the model is sharded)
    ar = timed(mirrored_ar(model, tokenizer, ids, args.max_tokens, sampling_kwargs(args)))
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
    from ..loop.stats import arm_lines

    for line in arm_lines(spec.stats):
        print(f"[compare-ar] {line}", file=sys.stderr)


def _compare_stock(tokenizer: Any, ids: list[int], args: argparse.Namespace, spec: Any) -> None:
    """Stock mlx-lm on the same ids in its own process (bench/stock.py), after one untimed
    generation there."""
    from ..bench.stock import StockPeer, stock_source
    from ..warmup import warm_ids

    with StockPeer(stock_source(args.model), sampling_kwargs(args)) as stock:
        stock.warm(warm_ids(tokenizer, not args.ignore_chat_template))
        run = stock.run(ids, args.max_tokens)
    same = run.tokens == spec.tokens
    ratio = spec.decode_tok_s / run.decode_tok_s if run.decode_tok_s else 0.0
    print(
        f"[compare-stock] stock mlx-lm {run.decode_tok_s:.1f} tok/s, adaspec "
        f"{spec.decode_tok_s:.1f} tok/s, speedup {ratio:.2f}x, identical: {same}"
        + ("" if same or args.temp == 0 else " (expected at T>0: different draws)"),
        file=sys.stderr,
    )
