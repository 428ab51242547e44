"""Decode throughput of requests decoded together, in one process (no HTTP, prefill excluded):
adaspec's batch (serve/batch.py, each request with its own drafters and policy) against
mlx-lm's BatchGenerator (`batch_generate`) on the same held-out chat requests, T=0, at each
level of concurrency, interleaved; plus whether every request's tokens are the same.

    python benchmarks/serve_batch.py --model smollm2-135m --levels 1,2,4,8 --max-tokens 96
        [--compare-split]

--compare-split also times adaspec's batch with attention through mlx-lm's module once per
request (targets/batch.py's shared path, the native nodes, off), in turn with the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("ADASPEC_SUFFIX_MAX_ONLINE", "0")  # repeats must not teach the drafter


def requests(tokenizer, n: int) -> list[list[int]]:
    """n held-out chat requests, round-robin over the dev suite's categories."""
    path = Path(__file__).resolve().parent / "prompts" / "dev.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    cats: dict[str, list] = {}
    for r in rows:
        cats.setdefault(r["category"], []).append(r["messages"])
    order = [m for i in range(max(map(len, cats.values()))) for c in cats.values() if i < len(c)
             for m in [c[i]]]  # fmt: skip
    return [
        tokenizer.apply_chat_template(order[i % len(order)], add_generation_prompt=True)
        for i in range(n)
    ]


def run_mlx(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    from mlx_lm.generate import batch_generate

    r = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True)
    return r.stats.generation_tps, [list(t) for t in r.token_ids]


def run_adaspec(model, tokenizer, prompts, max_tokens: int, drafter: str) -> tuple[float, list]:
    from adaspec.api import make_prompt_cache, start_decoder
    from adaspec.serve.batch import Batch, join

    batch, got = Batch(), [[] for _ in prompts]
    eos = set(tokenizer.eos_token_ids)
    for i, p in enumerate(prompts):
        cache = make_prompt_cache(model, tokenizer, drafter=drafter)
        dec, ids = start_decoder(
            model, tokenizer, p, max_tokens=max_tokens, prompt_cache=cache, shared_forward=True
        )

        def emit(r, i=i):
            got[i].append(r.token)
            return r.finish_reason is not None

        batch.add(join(dec, ids, tokenizer, emit, cache))
    t0 = time.perf_counter()
    while batch.members:
        batch.step()
    wall = time.perf_counter() - t0
    tokens = sum(len(g) for g in got)
    return (tokens - len(prompts)) / wall, [[t for t in g if t not in eos] for g in got]


def _split_figures(r: dict) -> dict:
    if not r["split"]:
        return {}
    split = statistics.median(r["split"])
    return {
        "adaspec_split_attention_decode_tps": round(split, 1),
        "split_attention_ratio": round(split / statistics.median(r["mlx_lm"]), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--compare-split", action="store_true",
        help="also time adaspec with attention through mlx-lm's module once per request "
        "(targets/batch.py without its shared native path), taking turns",
    )  # fmt: skip
    a = ap.parse_args()

    import adaspec
    from adaspec.targets import batch as batch_forward

    shared = batch_forward.shared_unsupported

    def split_run(*args):
        batch_forward.shared_unsupported = lambda *_: "split"
        try:
            return run_adaspec(*args)
        finally:
            batch_forward.shared_unsupported = shared

    model, tokenizer = adaspec.load(a.model)
    levels = [int(x) for x in a.levels.split(",")]
    prompts = requests(tokenizer, max(levels))
    run_mlx(model, tokenizer, prompts[:2], 8)  # warm up both
    run_adaspec(model, tokenizer, prompts[:2], 8, a.drafter)
    rates: dict = {n: {"mlx_lm": [], "adaspec": [], "split": []} for n in levels}
    same: dict = {}
    for _ in range(a.repeats):
        for n in levels:
            m_tps, m_tok = run_mlx(model, tokenizer, prompts[:n], a.max_tokens)
            a_tps, a_tok = run_adaspec(model, tokenizer, prompts[:n], a.max_tokens, a.drafter)
            rates[n]["mlx_lm"].append(m_tps)
            rates[n]["adaspec"].append(a_tps)
            same[n] = same.get(n, True) and [t[: len(u)] for t, u in zip(m_tok, a_tok)] == a_tok
            if a.compare_split:
                s_tps, s_tok = split_run(model, tokenizer, prompts[:n], a.max_tokens, a.drafter)
                rates[n]["split"].append(s_tps)
                same[n] = same[n] and s_tok == a_tok
            print(n, round(m_tps, 1), round(a_tps, 1), rates[n]["split"][-1:], same[n],
                  file=sys.stderr)  # fmt: skip
    one = statistics.median(rates[levels[0]]["adaspec"])
    result = {
        "model": a.model,
        "drafter": a.drafter,
        "max_tokens": a.max_tokens,
        "load": Path("/proc/loadavg").read_text().split()[:3],
        "levels": {
            n: {
                "mlx_lm_decode_tps": round(statistics.median(r["mlx_lm"]), 1),
                "adaspec_decode_tps": round(statistics.median(r["adaspec"]), 1),
                "ratio": round(statistics.median(r["adaspec"]) / statistics.median(r["mlx_lm"]), 2),
                "adaspec_vs_its_first_level": round(statistics.median(r["adaspec"]) / one, 2),
                "same_tokens": same[n],
                **_split_figures(r),
            }
            for n, r in rates.items()
        },
    }
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
