"""`adaspec build-suffix`: a data file for the `suffix` drafter, from a response store (the
greedy answers `adaspec train-dflash` keeps) or from text the target generated."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "build-suffix", help="build a data file for the suffix drafter from a target's outputs"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--store", help="a response store folder (index.json + responses-*.npz)")
    src.add_argument("--text", nargs="+", help="text files the target wrote, one response each")
    p.add_argument("--model", default=None, help="the target (needed with --text)")
    p.add_argument("--out", required=True, help="the data file to write (.npz)")
    p.add_argument("--prompts", action="store_true", help="also index the store's prompts")
    p.add_argument("--depth", type=int, default=32, help="build and time the index to this depth")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ..drafters.suffix_index import SuffixIndex
    from ..drafters.suffix_store import load_data, save_data
    from ..errors import DrafterError

    if args.store:
        folder = Path(args.store)
        if not (folder / "index.json").is_file():
            raise DrafterError(
                f"--store {args.store!r} has no index.json; accepted: a response store folder"
            )
        from ..train.store import ResponseStore

        fp = json.loads((folder / "index.json").read_text())["target"]
        answers = ResponseStore(folder, fp).load().values()
        seqs = [a.response for a in answers]
        if args.prompts:
            seqs += [a.prompt for a in answers]
        target = {k: fp[k] for k in ("model_type", "vocab_size", "hidden_size", "num_layers")}
    else:
        if not args.model:
            raise DrafterError("--text needs --model (its tokenizer); accepted: a model name")
        from ..drafters.suffix_store import target_key
        from ..targets.base import target_info
        from ..targets.loader import load

        model, tok = load(args.model)  # its tokenizer is what is used (not warmed up)
        seqs = [tok.encode(Path(f).read_text(), add_special_tokens=False) for f in args.text]
        target = target_key(target_info(model, tok))
    path = save_data(args.out, seqs, target)
    t0 = time.perf_counter()
    stream = load_data(path)
    index = SuffixIndex(stream, args.depth)
    print(
        f"{path}: {int((stream >= 0).sum())} tokens from {len(seqs)} sequences, "
        f"{path.stat().st_size / 1e6:.2f} MB on disk; index built in "
        f"{time.perf_counter() - t0:.2f} s, {index.nbytes / 1e6:.1f} MB in memory"
    )
    return 0
