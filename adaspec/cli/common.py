"""Flags shared by the generate and bench subcommands."""

from __future__ import annotations

import argparse

DEFAULT_MODEL = "smollm2-135m"


def add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"mlx-lm folder, HF id, .gguf file or catalogue name (default {DEFAULT_MODEL})",
    )


def add_model_flags(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    p.add_argument(
        "--drafter",
        default=None,
        metavar="NAME[:ARG][+NAME[:ARG]...]",
        help="none, pld, auto, dflash:DIR, draft-model:M or any registered drafter, or several "
        "joined by + (the policy picks one per step); ARG is PATH[,KEY=VALUE...] "
        "(default: auto, the model's default combination)",
    )
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling (0 or 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="feed the prompt as plain text even if the model has a chat template",
    )


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return {
        "temp": args.temp,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
    }


def load_model(name: str):
    """(model, tokenizer), on the CPU fast paths (kernels/fast_ops.py, stock mlx's bits):
    mlx-lm's own generate on this model then takes the same path as adaspec"""
    from ..api import load
    from ..kernels import fast_ops

    model, tokenizer = load(name)
    fast_ops.install(model)
    return model, tokenizer


def drafter_plan(args: argparse.Namespace, model, tokenizer):
    """--drafter (default: auto) for this model, as a DrafterPlan: parsed, `auto` expanded and
    every arm's arguments checked before anything is generated."""
    from ..drafters.arms import DEFAULT, plan
    from ..settings import get
    from ..targets.base import target_info

    spec = DEFAULT if args.drafter is None else args.drafter
    return plan(spec, target_info(model, tokenizer), get())
