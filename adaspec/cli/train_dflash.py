"""`adaspec train-dflash`: train a DFlash drafter for a target by self-distillation."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path

from ..train.corpus import SHIPPED_CORPUS
from ..train.recipe import Hyper, Recipe, tiny_recipe
from .common import DEFAULT_MODEL, load_model

_RECIPE = {f.name: f for f in fields(Recipe) if f.name not in ("corpus", "hyper")}
_HYPER = {f.name: f for f in fields(Hyper)}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train-dflash",
        help="train a DFlash drafter for a target (resumable)",
        description="Corpus -> prompts -> the target's own responses (kept as token ids in "
        "--data) -> one target forward per sequence (tap features and the target's labels) -> "
        "drafter (z-lab format) with a model card. Re-run the same command to resume.",
    )
    p.add_argument(
        "--target", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})"
    )
    p.add_argument("--out", required=True, help="output folder (checkpoint + work/ for resume)")
    p.add_argument(
        "--corpus",
        default=str(SHIPPED_CORPUS),
        help="folder with news.txt and code_modules.txt (default: the corpus adaspec ships)",
    )
    p.add_argument("--tiny", action="store_true", help="a minutes-long end-to-end run (CI)")
    p.add_argument(
        "--plan",
        action="store_true",
        help="print what a run would train on (prompts, stored answers, labelled positions) "
        "and exit, without generating or training",
    )
    p.add_argument(
        "--generate-only",
        action="store_true",
        help="answer the prompts the store lacks (up to --respond), then exit: grows the data",
    )
    for name, f in {**_RECIPE, **_HYPER}.items():
        kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" ")[0], None)
        if name == "mask_token_id":
            kind = int
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=kind or str,
            default=None,
            help=f"default {f.default if f.default is not None else 'automatic'}",
        )
    p.set_defaults(func=run)


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    hyper = Hyper(**{k: getattr(args, k) for k in _HYPER if getattr(args, k) is not None})
    base = Recipe(corpus=args.corpus, hyper=hyper)
    if args.tiny:
        base = tiny_recipe(base)
    over = {k: getattr(args, k) for k in _RECIPE if getattr(args, k) is not None}
    hover = {k: getattr(args, k) for k in _HYPER if getattr(args, k) is not None}
    return replace(base, **over, hyper=replace(base.hyper, **hover))


def default_data(target: str) -> Path:
    """The repo's response store for `target` (data/dflash/<name>, next to the adaspec package
    in a checkout), else data/dflash/<name> under the working directory."""
    from ..train.store import checkout_root

    name = Path(target.rstrip("/")).name.lower()
    return (checkout_root() or Path.cwd()) / "data" / "dflash" / name


def run(args: argparse.Namespace) -> int:
    from ..train.pipeline import grow, plan, train_dflash

    recipe = recipe_from_args(args)
    if recipe.data is None:
        # --tiny answers keep to the output folder; real ones go to the repo's store
        data = Path(args.out) / "work" / "responses" if args.tiny else default_data(args.target)
        recipe = replace(recipe, data=str(data))
    model, tokenizer = load_model(args.target)
    if args.plan:
        print(json.dumps(plan(model, tokenizer, recipe, str(recipe.data)), indent=1))
        return 0
    if args.generate_only:
        index = grow(model, tokenizer, recipe, str(recipe.data))
        print(json.dumps({k: v for k, v in index.items() if k != "shards"}, indent=1))
        return 0
    m = train_dflash(model, tokenizer, args.out, recipe, target_name=args.target)
    last = m["evals"][-1] if m["evals"] else {}
    print(
        json.dumps(
            {
                "out": args.out,
                "steps": m["steps"],
                "final_train_loss": m["final_train_loss"],
                "heldout": {k: last.get(k) for k in ("loss", "tau")},
            },
        )
    )
    return 0
