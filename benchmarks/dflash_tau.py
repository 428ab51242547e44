"""tau of a drafter per dev-suite category at a fixed draft length, untimed: every step
speculates (ADASPEC_GATE=off, no adaptive length), so tau = committed tokens per verify step is
the drafter's quality, not the policy's. T=0; each output is checked against mlx-lm's greedy AR.

    python benchmarks/dflash_tau.py [--drafter dflash] [--drafter auto] [--k 7] [--max-tokens 128]
        [--tree-nodes 0] [--tree-nodes 16]   (each drafter with each node budget; 0 = chains)
"""

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import adaspec  # noqa: F401  (fast BLAS before mlx)
from adaspec.api import stream_generate
from adaspec.bench.suite import load_suite
from adaspec.prompting import prompt_ids
from adaspec.settings import from_env
from adaspec.targets.loader import load

SUITE = Path(__file__).resolve().parent / "prompts" / "dev.jsonl"


def greedy_ar(model, tok, ids: list[int], n: int) -> list[int]:
    import mlx_lm  # after adaspec: the fast BLAS is loaded before mlx

    return [r.token for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", action="append", default=[])
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tree-nodes", action="append", default=[])
    ap.add_argument("--every", type=int, default=1, help="every Nth prompt of the suite")
    args = ap.parse_args()
    trees = args.tree_nodes or ["0"]
    drafters = [
        (d, t, f"{d}" + (f" tree {t}" if len(trees) > 1 else ""))
        for d in args.drafter or ["dflash", "auto"]
        for t in trees
    ]
    model, tok = load(args.model)
    base = dict(gate="off", draft_adaptive=False, draft_max=args.k)
    prompts = load_suite(SUITE)[:: args.every][: args.limit]
    rows = []
    for p in prompts:
        ids = prompt_ids(tok, p.messages)
        n = args.max_tokens
        want = greedy_ar(model, tok, ids, n)
        for d, tree, label in drafters:
            got, last = [], None
            settings = from_env({}, tree_nodes=tree, **base)
            for r in stream_generate(model, tok, ids, drafter=d, max_tokens=n, settings=settings):
                got.append(r.token)
                last = r
            s = last.stats
            rows.append(
                {
                    "id": p.id,
                    "category": p.category,
                    "drafter": label,
                    "tree_nodes": s.tree_nodes,
                    "tau": s.spec_committed / max(s.spec_steps, 1),
                    "steps": s.spec_steps,
                    "at": list(s.accepted_at),
                    "of": list(s.drafted_at),
                    "identical": got == want,
                }
            )
            same = "" if rows[-1]["identical"] else "  DIFFERS from AR"
            print(f"{p.id:20s} {label:14s} tau {rows[-1]['tau']:.2f}{same}", flush=True)
    drafters = [label for _, _, label in drafters]
    by = defaultdict(list)
    for r in rows:
        by[(r["drafter"], r["category"])].append(r["tau"])
    cats = sorted({r["category"] for r in rows})
    print(f"\nT=0, k={args.k}, {len(prompts)} prompts, up to {args.max_tokens} tokens each")
    print("| category | " + " | ".join(f"tau {d}" for d in drafters) + " |")
    print("|---|" + "---|" * len(drafters))
    for c in cats:
        cells = [f"{statistics.fmean(by[(d, c)]):.2f}" for d in drafters]
        print(f"| {c} | " + " | ".join(cells) + " |")
    means = [statistics.fmean(r["tau"] for r in rows if r["drafter"] == d) for d in drafters]
    print("| all (mean of prompts) | " + " | ".join(f"{m:.2f}" for m in means) + " |")
    print("identical to AR:", all(r["identical"] for r in rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "prompts": rows}, indent=2))


if __name__ == "__main__":
    main()
