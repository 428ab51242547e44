"""`adaspec serve`: mlx-lm's OpenAI-compatible server, every flag of `mlx_lm.server`, plus
--drafter; generation goes through adaspec's speculative decoder."""

from __future__ import annotations

import argparse
import logging
import types

from ..errors import GenerationArgumentError
from .common import add_model_flag

# mlx_lm.server flags for machinery adaspec serve replaces: refused unless left at default
NOT_READ = (
    "kv_bits",
    "kv_group_size",
    "quantized_kv_start",
    "decode_concurrency",
    "prompt_concurrency",
    "num_draft_tokens",
    "pipeline",
)


class _Captured(Exception):
    pass


def mlx_lm_server_parser() -> argparse.ArgumentParser:
    """The parser `mlx_lm.server.main` builds, taken before it parses anything, so the flags
    stay mlx-lm's own (only mlx_lm.server's module-level `argparse` name is swapped)."""
    import mlx_lm.server as server

    built: list[argparse.ArgumentParser] = []

    class Parser(argparse.ArgumentParser):
        def parse_args(self, *a, **k):  # type: ignore[override]
            built.append(self)
            raise _Captured

    real = server.argparse
    server.argparse = types.SimpleNamespace(ArgumentParser=Parser)  # type: ignore[assignment]
    try:
        server.main()
    except _Captured:
        pass
    finally:
        server.argparse = real
    return built[0]


def add_parser(sub) -> None:
    # mlx-lm's flags are read in run(): building their parser imports mlx_lm (~2 s), which
    # other subcommands should not pay for
    p = sub.add_parser(
        "serve",
        add_help=False,
        help="OpenAI-compatible server (mlx_lm.server's flags and API), speculating; "
        "adaspec serve -h lists the flags",
    )
    p.set_defaults(func=run, takes_extra=True)


def build_parser() -> argparse.ArgumentParser:
    from . import DefaultsFormatter

    refused = ", ".join(f"--{k.replace('_', '-')}" for k in NOT_READ)
    p = argparse.ArgumentParser(
        prog="adaspec serve",
        parents=[mlx_lm_server_parser()],
        conflict_handler="resolve",
        description=__doc__,
        formatter_class=DefaultsFormatter,
        epilog=f"Refused unless left at their defaults (adaspec serve replaces the machinery "
        f"they tune: KV quantization, batching, mlx-lm's fixed draft length, distributed "
        f"serving): {refused}.",
    )
    for action in p._actions:
        if action.dest in NOT_READ:
            action.help = f"{action.help or ''} [refused by adaspec serve unless left at default]"
    add_model_flag(p)
    from . import add_plugin_flag

    add_plugin_flag(p)  # read by the adaspec command before this parser; listed for -h
    p.add_argument(
        "--drafter",
        default="auto",
        help="drafter spec for requests that name none (default: auto, the model's default "
        "combination); a request's 'drafter' field overrides it; --draft-model M without "
        "--drafter means auto:draft-model:M (prompt lookup, then the model)",
    )
    return p


def run(ns: argparse.Namespace) -> int:
    from mlx_lm.server import ModelProvider

    from ..serve import check_drafter
    from ..serve import run as serve
    from ..targets.loader import resolve

    parser = build_parser()
    args = parser.parse_args(ns.extra)
    unread = [
        f"--{k.replace('_', '-')}" for k in NOT_READ if getattr(args, k) != parser.get_default(k)
    ]
    if unread:
        raise GenerationArgumentError(
            f"adaspec serve does not read {', '.join(unread)} (KV quantization, batching, "
            "mlx-lm's fixed draft length, distributed serving); accepted: leave them unset"
        )
    logging.getLogger().setLevel(args.log_level.upper())
    args.model, _ = resolve(args.model)
    drafter = args.drafter
    if args.draft_model and "--drafter" not in ns.extra:
        drafter = f"auto:draft-model:{args.draft_model}"
    args.draft_model = None  # a draft model is an adaspec drafter here, not mlx-lm's
    check_drafter(drafter)
    logging.info("adaspec serve: %s, drafter %s", args.model, drafter)
    serve(args.host, args.port, ModelProvider(args), drafter)
    return 0
