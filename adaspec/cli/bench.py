"""`adaspec bench`: AR (mlx-lm) vs adaspec per prompt of a suite, interleaved, medians; peers:
mlx-lm's speculative decoding, stock mlx-lm in a process of its own."""

from __future__ import annotations

import argparse
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .common import add_model_flags, drafter_plan, load_model, sampling_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark adaspec against mlx-lm AR on a prompt suite")
    add_model_flags(p)
    p.add_argument(
        "--suite",
        default=None,
        metavar="JSONL",
        help="prompt suite, one JSON record a line (default: the suite shipped with adaspec)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and side")
    p.add_argument("--max-tokens", type=int, default=None, help="override each prompt's")
    p.add_argument(
        "--category",
        action="append",
        default=[],
        help="only this category (repeat the flag, or join several with commas)",
    )
    p.add_argument(
        "--grounded",
        choices=["yes", "no"],
        default=None,
        help="only grounded (yes) or open (no) prompts",
    )
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--json", default=None, help="write records + summary here")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw speedup per category, acceptance by draft position and floored steps here "
        "(needs matplotlib: the `plot` extra)",
    )
    p.add_argument(
        "--peer",
        default=None,
        metavar="mlx-lm-spec|mlx-lm-stock",
        help="add a peer's columns, interleaved: mlx-lm-spec (mlx-lm's own speculative "
        "decoding, in this process), mlx-lm-stock (stock mlx-lm in a process that never "
        "imports adaspec: the mlx wheel's own BLAS and kernels, the model's fp32 expansion); "
        "both: joined by a comma",
    )
    p.add_argument(
        "--peer-draft",
        default=None,
        metavar="PATH_OR_NAME",
        help="the peer's draft model (default: the model of --drafter [auto:]draft-model:...)",
    )
    p.add_argument(
        "--peer-k",
        type=int,
        default=0,
        help="the peer's num_draft_tokens (default 0: the best of 2..6 on the first prompts)",
    )
    p.add_argument("--peer-tune-prompts", type=int, default=2, help="prompts used to pick --peer-k")
    p.add_argument(
        "--peer-tune-tokens", type=int, default=48, help="tokens per run when picking --peer-k"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import settings as settings_mod
    from ..bench import load_suite
    from ..bench.peer import peer_names
    from ..distributed import run_ranks
    from ..errors import GenerationArgumentError

    if args.repeats < 1:
        raise GenerationArgumentError(f"--repeats={args.repeats} is invalid; accepted: >= 1")
    peer_names(args.peer)  # an unknown peer fails before the model loads
    if args.plot:  # fail before the run, not after it
        from ..bench.plot import pyplot

        pyplot()
    suite = select(load_suite(args.suite), args.category, args.grounded, args.limit)
    model, tokenizer = load_model(args.model)
    kind = settings_mod.get().shard
    return run_ranks(model, tokenizer, kind, lambda: _run(args, suite, model, tokenizer))


def _run(args: argparse.Namespace, suite: list, model: Any, tokenizer: Any) -> int:
    from ..bench import SHIPPED, markdown, run_suite, save
    from ..distributed.shard import sharding
    from ..errors import GenerationArgumentError

    drafter = drafter_plan(args, model, tokenizer)
    if args.peer is not None and sharding(model) is not None:
        raise GenerationArgumentError(
            "--peer runs mlx-lm on the whole model in one process, beside a target split over "
            "ranks; accepted on a sharded target: no --peer"
        )
    peer = _peer(args, drafter)
    with _stock(args) as stock:
        result = run_suite(
            model,
            tokenizer,
            suite,
            drafter=drafter,
            repeats=args.repeats,
            max_tokens=args.max_tokens,
            spec_kwargs=sampling_kwargs(args),
            use_template=not args.ignore_chat_template,
            peer=peer,
            stock=stock,
        )
    suite_name = args.suite or str(SHIPPED)
    result["config"].update(model=args.model, suite=suite_name, max_tokens=args.max_tokens)
    shard = sharding(model)
    result["config"]["target"] = shard.describe() if shard else "one process"
    print(markdown(result["records"], result["summary"]))
    if args.json:
        save(result, args.json)
    if args.plot:
        from ..bench.plot import plot

        print(f"plot: {plot(result, args.plot)}")
    return 0


def select(suite: list, category: list[str], grounded: str | None, limit: int | None) -> list:
    """The prompts of `suite` in the given categories (each entry one name or several joined by
    commas; none: all), grounded or open ("yes" / "no" / None), the first `limit`."""
    from ..errors import GenerationArgumentError

    if category:
        wanted = {c.strip() for arg in category for c in arg.split(",") if c.strip()}
        known = sorted({p.category for p in suite})
        unknown = sorted(wanted.difference(known))
        if unknown:
            raise GenerationArgumentError(
                f"--category {', '.join(unknown)} is not in the suite; accepted: {', '.join(known)}"
            )
        suite = [p for p in suite if p.category in wanted]
    if grounded:
        suite = [p for p in suite if p.grounded == (grounded == "yes")]
    suite = suite[:limit]
    if not suite:
        raise GenerationArgumentError("no prompts left after --category/--grounded/--limit")
    return suite


def _stock(args: argparse.Namespace) -> AbstractContextManager[Any]:
    """The stock mlx-lm worker when --peer names mlx-lm-stock (started, its model loaded),
    else nothing; closed when the block ends."""
    from ..bench.peer import peer_names
    from ..bench.stock import NAME, StockPeer, stock_source

    if NAME not in peer_names(args.peer):
        return nullcontext()
    return StockPeer(stock_source(args.model), sampling_kwargs(args))


def _peer(args: argparse.Namespace, drafter: Any) -> Any:
    """The --peer mlx-lm-spec configuration, or None (its draft model loaded once, with fp32
    weights as mlx-lm reads them, and shared with a drafter that drafts from those); `drafter`
    is the plan in use (--drafter or the model's default): its draft-model arm names the
    default draft."""
    from ..bench.peer import SPEC_PEER, PeerConfig, check_peer, peer_names
    from ..drafters.draft_model import load_shared
    from ..errors import GenerationArgumentError
    from ..settings import get

    if SPEC_PEER not in peer_names(args.peer):
        return None
    draft = args.peer_draft
    arm = drafter.find("draft-model")
    if draft is None and arm is not None:
        draft = arm.args.path
    check_peer(args.peer, draft)
    if not 0 <= args.peer_k <= 64 or args.peer_tune_prompts < 1 or args.peer_tune_tokens < 2:
        raise GenerationArgumentError(
            f"--peer-k={args.peer_k}, --peer-tune-prompts={args.peer_tune_prompts}, "
            f"--peer-tune-tokens={args.peer_tune_tokens} are invalid; accepted: 0..64, >= 1, >= 2"
        )
    model, _, _ = load_shared(draft, get())
    return PeerConfig(model, args.peer_k, args.peer_tune_prompts, args.peer_tune_tokens)
