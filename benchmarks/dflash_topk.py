"""What a draft tree could collect from a DFlash drafter: along the target's own greedy
continuation, how often the target's token is the drafter's 1st, 2nd, 3rd, 4th choice at block
positions 1..P, and how often the first miss of a chain would have been caught by a sibling.

    python benchmarks/dflash_topk.py [--limit 10] [--max-tokens 128] [--positions 4]
"""

import argparse
from pathlib import Path

import numpy as np

import adaspec  # noqa: F401  (fast BLAS before mlx)
from adaspec.bench.suite import load_suite
from adaspec.drafters.base import DraftContext
from adaspec.drafters.dflash import checkpoint_dir
from adaspec.drafters.dflash import load as load_dflash
from adaspec.prompting import prompt_ids
from adaspec.targets import make_target
from adaspec.targets.loader import load

SUITE = Path(__file__).resolve().parent / "prompts" / "dev.jsonl"
TOP = 4


def ranks_along(target, drafter, ids: list[int], n: int, P: int) -> list[list[int]]:
    """For each committed position of the greedy continuation: the drafter's rank (0-based,
    TOP = not in its top TOP) of the target's next P tokens at block positions 1..P."""
    import mlx.core as mx

    taps = drafter.needs_taps
    feats = target.prefill(ids[:-1], taps)
    committed = list(ids)
    drafter.prefill(committed, DraftContext(committed, 0, feats))
    rows, out = [], []
    for _ in range(n):
        fwd = target.forward([committed[-1]], taps)
        logits = drafter.block_logits(P)
        top = mx.argsort(-logits, axis=-1)[:, :TOP]
        nxt = int(mx.argmax(fwd.logits[-1]).item())
        rows.append(np.array(top))
        committed.append(nxt)
        drafter.advance([nxt], DraftContext(committed, 0, fwd.features))
        out.append(nxt)
    ids_map = drafter.head.ids
    result = []
    for i, top in enumerate(rows):
        if i + P > len(out):
            break
        if ids_map is not None:
            top = ids_map[top]
        r = []
        for j in range(P):
            hit = np.nonzero(top[j] == out[i + j])[0]
            r.append(int(hit[0]) if hit.size else TOP)
        result.append(r)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--positions", type=int, default=4)
    args = ap.parse_args()
    model, tok = load(args.model)
    P = args.positions
    prompts = load_suite(SUITE)
    step = max(1, len(prompts) // args.limit)
    prompts = prompts[::step][: args.limit]
    all_ranks = []
    for p in prompts:
        target = make_target(model, tok)
        drafter = load_dflash(checkpoint_dir(None, target.info, "dflash"), target.info)
        P = min(args.positions, drafter.block - 1)  # a block drafts block - 1 positions
        r = ranks_along(target, drafter, prompt_ids(tok, p.messages), args.max_tokens, P)
        all_ranks += r
        print(f"{p.id:24s} {p.category:12s} top1@1 {np.mean([x[0] == 0 for x in r]):.2f}")
    R = np.array(all_ranks)
    print(f"\n{len(prompts)} prompts, {len(R)} positions, T=0 target continuation")
    print("| position | " + " | ".join(f"choice {c + 1}" for c in range(TOP)) + " | in top 4 |")
    print("|---|" + "---|" * (TOP + 1))
    for j in range(P):
        cells = [f"{np.mean(R[:, j] == c):.3f}" for c in range(TOP)]
        print(f"| {j + 1} | " + " | ".join(cells) + f" | {np.mean(R[:, j] < TOP):.3f} |")
    # chain vs a width-w tree along the first miss: expected accepted drafts per step
    for w in (1, 2, 4):
        acc = [next((j for j in range(P) if r[j] >= w), P) for r in R]
        print(f"accepted of {P} (path through top-{w} at every position): {np.mean(acc):.3f}")


if __name__ == "__main__":
    main()
