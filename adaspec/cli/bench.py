"""`adaspec bench`: AR (mlx-lm) vs adaspec per prompt of a suite, interleaved, medians; peers
(adaspec/bench/peers.py): mlx-lm's speculative decoding, stock mlx-lm in a process of its own,
llama.cpp."""

from __future__ import annotations

import argparse
import signal
import threading
from contextlib import ExitStack
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
    _add_peer_flags(p)
    p.set_defaults(func=run)


def _add_peer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--peer",
        default=None,
        metavar="mlx-lm-spec|mlx-lm-stock|llama.cpp",
        help="add peers' columns, interleaved per prompt (several: joined by commas): "
        "mlx-lm-spec (mlx-lm's own speculative decoding, in this process), mlx-lm-stock "
        "(stock mlx-lm in a process that never imports adaspec: the mlx wheel's own BLAS and "
        "kernels, the model's fp32 expansion), llama.cpp (the same GGUF and prompt ids, plain "
        "and with --spec-type ngram-mod)",
    )
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="--peer llama.cpp: a llama-server binary (default: the xllamacpp wheel, the "
        "`llamacpp` extra)",
    )
    p.add_argument(
        "--llama-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="--peer llama.cpp: add to the llama-server binary's environment (repeat the flag), "
        "e.g. OMP_WAIT_POLICY=PASSIVE (its OpenMP threads sleep at a barrier instead of spinning)",
    )
    p.add_argument(
        "--llama-threads",
        type=int,
        default=0,
        help="--peer llama.cpp: its threads (default 0: the cores this process may use)",
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


def run(args: argparse.Namespace) -> int:
    from .. import settings as settings_mod
    from ..bench import load_suite
    from ..distributed import run_ranks
    from ..errors import GenerationArgumentError

    if args.repeats < 1:
        raise GenerationArgumentError(f"--repeats={args.repeats} is invalid; accepted: >= 1")
    check_peers(args)  # a bad peer flag fails before the model loads
    if args.plot:  # fail before the run, not after it
        from ..bench.plot import pyplot

        pyplot()
    suite = select(load_suite(args.suite), args.category, args.grounded, args.limit)
    model, tokenizer = load_model(args.model)
    kind = settings_mod.get().shard
    return run_ranks(model, tokenizer, kind, lambda: _run(args, suite, model, tokenizer))


def _run(args: argparse.Namespace, suite: list, model: Any, tokenizer: Any) -> int:
    from ..bench import SHIPPED, machine, markdown, run_suite, save
    from ..distributed.shard import sharding
    from ..errors import GenerationArgumentError
    from ..kernels import arithmetic

    drafter = drafter_plan(args, model, tokenizer)
    if args.peer is not None and sharding(model) is not None:
        raise GenerationArgumentError(
            "--peer runs mlx-lm on the whole model in one process, beside a target split over "
            "ranks; accepted on a sharded target: no --peer"
        )
    measured = machine.measure()  # before anything of the run is in the caches
    with ExitStack() as stack:
        if args.peer and threading.current_thread() is threading.main_thread():
            # terminated, the bench still ends the peers' processes (a worker, servers)
            stack.callback(signal.signal, signal.SIGTERM, signal.signal(signal.SIGTERM, _stop))
        peers = start_peers(args, model, tokenizer, drafter, stack)
        result = run_suite(
            model,
            tokenizer,
            suite,
            drafter=drafter,
            repeats=args.repeats,
            max_tokens=args.max_tokens,
            spec_kwargs=sampling_kwargs(args),
            use_template=not args.ignore_chat_template,
            peers=peers,
        )
    suite_name = args.suite or str(SHIPPED)
    result["config"].update(model=args.model, suite=suite_name, max_tokens=args.max_tokens)
    shard = sharding(model)
    result["config"]["target"] = shard.describe() if shard else "one process"
    result["config"]["arithmetic"] = arithmetic.describe(model)  # the target's and AR's GEMMs
    result["config"]["machine"] = {**measured, "load_end": machine.load()}
    print(markdown(result["records"], result["summary"]))
    print(machine.line(result["config"]["machine"]))
    print(f"arithmetic: {result['config']['arithmetic']}")
    for described in result["config"].values():
        if isinstance(described, dict) and "build" in described:
            print(f"{described['name']}: {described['build']}")
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


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def peer_options(args: argparse.Namespace) -> Any:
    from ..bench.peers import PeerOptions

    return PeerOptions(
        draft=args.peer_draft,
        k=args.peer_k,
        tune_prompts=args.peer_tune_prompts,
        tune_tokens=args.peer_tune_tokens,
        llama_server=args.llama_server,
        llama_threads=args.llama_threads,
        llama_env=tuple(args.llama_env),
    )


def check_peers(args: argparse.Namespace) -> list[str]:
    """The --peer names, each kind's flags checked (before the model loads)."""
    from ..bench.llamacpp import NAME as LLAMA
    from ..bench.peer_kinds import kinds, peer_names
    from ..errors import GenerationArgumentError

    names = peer_names(args.peer)
    if LLAMA not in names and (args.llama_server or args.llama_threads or args.llama_env):
        raise GenerationArgumentError(
            "--llama-server, --llama-threads and --llama-env set up the llama.cpp peer; "
            "accepted with --peer llama.cpp"
        )
    options = peer_options(args)
    for name in names:
        kinds()[name].check(options)
    return names


def start_peers(
    args: argparse.Namespace, model: Any, tokenizer: Any, drafter: Any, stack: ExitStack
) -> list:
    """The --peer peers, started, each closed when `stack` closes; `drafter` is the plan in
    use (its draft-model arm is mlx-lm-spec's default draft)."""
    from ..bench.peer_kinds import kinds
    from ..bench.peers import PeerRequest

    req = PeerRequest(
        args.model, model, tokenizer, drafter, sampling_kwargs(args), peer_options(args)
    )
    peers = []
    for name in check_peers(args):
        peer = kinds()[name].start(req)
        stack.callback(peer.close)
        peers.append(peer)
    return peers
