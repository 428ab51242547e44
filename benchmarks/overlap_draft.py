"""DFlash with the draft verified on its unevaluated ids (ADASPEC_OVERLAP_DRAFT=true) against
the draft read first (false), beside mlx-lm's AR, in one process: gates off at fixed draft
lengths, so both modes run the same steps, and the default gated policy. Per open dev prompt,
the modes alternate within each repetition (the order flips every repetition); each output is
checked against mlx-lm's greedy AR. Reports decode tok/s ratios (first token excluded).

    python benchmarks/overlap_draft.py [--drafter dflash] [--k 2 --k 3] [--reps 2] [--every 2]
        [--max-tokens 96] [--json out.json]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import adaspec  # noqa: F401  (fast BLAS before mlx)
from adaspec.api import stream_generate
from adaspec.bench.suite import load_suite
from adaspec.prompting import prompt_ids
from adaspec.settings import from_env
from adaspec.targets.loader import load

SUITE = Path(__file__).resolve().parent / "prompts" / "dev.jsonl"


def timed(events) -> tuple[list[int], float]:
    """The tokens and the decode rate after the first token."""
    toks, t0 = [], 0.0
    for r in events:
        toks.append(r.token)
        if len(toks) == 1:
            t0 = time.perf_counter()
    return toks, (len(toks) - 1) / (time.perf_counter() - t0)


def modes(ks: list[int]) -> dict[str, dict]:
    out = {}
    for k in ks:
        fixed = dict(gate="off", draft_adaptive=False, draft_max=k)
        out[f"k={k} read"] = dict(fixed, overlap_draft=False)
        out[f"k={k} lazy"] = dict(fixed, overlap_draft=True)
    out["gated read"] = dict(overlap_draft=False)
    out["gated lazy"] = dict(overlap_draft=True)
    return out


def run_prompt(model, tok, p, drafter: str, table: dict, reps: int, n: int) -> dict:
    import mlx_lm  # after adaspec: the fast BLAS is loaded before mlx

    ids = prompt_ids(tok, p.messages)
    rates: dict[str, list[float]] = {"ar": []}
    want = None
    for rep in range(reps):
        want, ar = timed(mlx_lm.stream_generate(model, tok, ids, max_tokens=n))
        rates["ar"].append(ar)
        names = list(table) if rep % 2 == 0 else list(reversed(table))
        for name in names:
            s = from_env({}, **table[name])
            events = stream_generate(model, tok, ids, drafter=drafter, max_tokens=n, settings=s)
            got, r = timed(events)
            if got != want:
                raise SystemExit(f"{p.id} {name}: output differs from mlx-lm's greedy AR")
            rates.setdefault(name, []).append(r)
    ar = statistics.median(rates.pop("ar"))
    return {name: statistics.median(v) / ar for name, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="dflash")
    ap.add_argument("--k", type=int, action="append", default=[])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--every", type=int, default=2, help="every Nth open prompt of the suite")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, tok = load(args.model)
    table = modes(args.k or [2, 3])
    prompts = [p for p in load_suite(SUITE) if not p.grounded][:: args.every]
    rows = []
    for p in prompts:
        ratios = run_prompt(model, tok, p, args.drafter, table, args.reps, args.max_tokens)
        rows.append({"id": p.id, "category": p.category, "x_ar": ratios})
        print(p.id, " ".join(f"{k}={v:.2f}" for k, v in ratios.items()), flush=True)
    print(f"\n{len(rows)} open prompts, {args.reps} runs each, decode tok/s vs mlx-lm AR")
    print("| mode | median | geometric mean | lazy / read (median of prompts) |")
    print("|---|---|---|---|")
    for name in table:
        v = [r["x_ar"][name] for r in rows]
        pair = name.replace("lazy", "read")
        gain = ""
        if name.endswith("lazy"):
            gain = f"{statistics.median(r['x_ar'][name] / r['x_ar'][pair] for r in rows):.3f}"
        mid, geo = statistics.median(v), statistics.geometric_mean(v)
        print(f"| {name} | {mid:.3f} | {geo:.3f} | {gain} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
