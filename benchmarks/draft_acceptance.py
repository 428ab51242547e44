"""Acceptance of sampled draft-model drafts verified by rejection sampling (with q) against the
same drafts verified by sample-and-match (q withheld), on the code prompts of the dev suite.

Both arms always speculate (ADASPEC_GATE=off) with a fixed draft length, so every position is
judged under the same rule; the arms alternate per prompt with the same seed.

    python benchmarks/draft_acceptance.py [--temp 0.7] [--k 4] [--max-tokens 64] [--limit N]
"""

import argparse
import json
from pathlib import Path

import adaspec  # noqa: F401  (fast BLAS before mlx)
from adaspec.api import stream_generate
from adaspec.prompting import prompt_ids
from adaspec.settings import from_env
from adaspec.targets.loader import load

SUITE = Path(__file__).resolve().parent / "prompts" / "dev.jsonl"
CODE = ("code-edit", "code-doc", "code-gen")


def run(model, tok, ids, drafter, args, settings) -> dict:
    *_, last = stream_generate(
        model,
        tok,
        ids,
        drafter=drafter,
        max_tokens=args.max_tokens,
        temp=args.temp,
        seed=args.seed,
        settings=settings,
    )
    s = last.stats
    return {
        "drafted": s.drafted,
        "accepted": s.accepted,
        "steps": s.spec_steps,
        "committed": s.spec_committed,
        "at": list(s.accepted_at),
        "of": list(s.drafted_at),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--temp", type=float, default=0.7)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, tok = load(args.model)
    settings = from_env({}, gate="off", draft_adaptive=False, draft_max=args.k)
    recs = [json.loads(line) for line in SUITE.read_text().splitlines()]
    recs = [r for r in recs if r["category"] in CODE][: args.limit]
    arms = {
        "rejection (q)": f"draft-model:{args.draft}",
        "sample-match": f"draft-model:{args.draft},q=0",
    }
    totals = {
        a: {
            "drafted": 0,
            "accepted": 0,
            "steps": 0,
            "committed": 0,
            "at": [0] * args.k,
            "of": [0] * args.k,
        }
        for a in arms
    }
    rows = []
    for r in recs:
        ids = prompt_ids(tok, r["messages"])
        for arm, drafter in arms.items():
            res = run(model, tok, ids, drafter, args, settings)
            t = totals[arm]
            for key in ("drafted", "accepted", "steps", "committed"):
                t[key] += res[key]
            for i in range(len(res["at"])):
                t["at"][i] += res["at"][i]
                t["of"][i] += res["of"][i]
            rate = res["accepted"] / max(res["drafted"], 1)
            rows.append({"id": r["id"], "arm": arm, **res, "acceptance": round(rate, 4)})
            print(
                f"{r['id']:18s} {arm:14s} acceptance {rate:.3f} "
                f"tau {res['committed'] / max(res['steps'], 1):.2f}",
                flush=True,
            )
    print(f"\nT={args.temp}, k={args.k}, {len(recs)} prompts, {args.max_tokens} tokens each")
    print("| verification | drafted | accepted | acceptance | tau | acceptance by position |")
    print("|---|---|---|---|---|---|")
    for arm, t in totals.items():
        by_pos = " / ".join(f"{a / o:.2f}" for a, o in zip(t["at"], t["of"]) if o)
        print(
            f"| {arm} | {t['drafted']} | {t['accepted']} | {t['accepted'] / t['drafted']:.3f} "
            f"| {t['committed'] / t['steps']:.2f} | {by_pos} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"config": vars(args), "totals": totals, "prompts": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
