"""Greedy output of a GGUF model with its weights at their stored bits against the same model
expanded to fp32: mlx-lm's own AR on every prompt of a suite, token by token.

    python benchmarks/stored_identity.py [--model smollm2-135m] [--suite FILE]
        [--max-tokens 128] [--json out.json]
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import json
import os
from datetime import date

import adaspec  # noqa: F401  (loads the BLAS before mlx)

from adaspec.bench.suite import load_suite
from adaspec.prompting import prompt_ids
from adaspec.settings import from_env
from adaspec.targets.loader import load


def greedy(model, tokenizer, ids: list[int], n: int) -> list[int]:
    import mlx_lm

    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--suite", default=None, help="prompt JSONL (default: the shipped prompts)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    models = {}
    for mode in ("on", "off"):
        settings = from_env({**os.environ, "ADASPEC_STORED_WEIGHTS": mode})
        models[mode] = load(a.model, settings=settings)
    (on, tok), (off, _) = models["on"], models["off"]
    assert hasattr(on, "adaspec_stored") and not hasattr(off, "adaspec_stored")
    records = []
    for prompt in load_suite(a.suite):
        ids = prompt_ids(tok, prompt.messages)
        n = min(a.max_tokens, prompt.max_tokens)
        got, want = greedy(on, tok, ids, n), greedy(off, tok, ids, n)
        diverge = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
        records.append({"id": prompt.id, "tokens": len(got), "identical": got == want,
                        "first_divergence": diverge})  # fmt: skip
        print(f"{prompt.id:24s} {len(got):4d} tokens  identical: {got == want}")
    same = sum(r["identical"] for r in records)
    print(f"{a.model}: {same}/{len(records)} identical, stored bits vs fp32 expansion")
    if a.json:
        out = {"date": date.today().isoformat(), "model": a.model, "suite": a.suite,
               "max_tokens": a.max_tokens, "identical": same, "prompts": len(records),
               "records": records}  # fmt: skip
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
