"""What the q8 arithmetic changes: greedy AR outputs of one model in exact and in q8 on a prompt
suite, how many are identical, where the first differing token falls, and the mean
log-likelihood per token the exact model gives each arithmetic's responses (its own are the
reference; a lower figure for q8's says how far from the exact model's choices they wander).
With --llama-server PATH, llama.cpp's greedy responses on the same GGUF and prompt ids too, for
scale (another engine's own rounding: its own 8-bit activations).

    python benchmarks/q8_divergence.py [--model smollm2-135m] [--suite benchmarks/prompts/dev.jsonl]
        [--max-tokens 128] [--category C,...] [--llama-server PATH] [--json out.json]
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import json
import statistics
from datetime import date

import adaspec

import mlx.core as mx
import numpy as np

from adaspec.bench import load_suite
from adaspec.bench.llama_server import HttpServer, LlamaServer, ServerConfig, check_binary
from adaspec.bench.llamacpp import gguf_of
from adaspec.kernels import arithmetic
from adaspec.prompting import prompt_ids


def greedy(model, tokenizer, ids: list[int], max_tokens: int) -> list[int]:
    return [r.token for r in adaspec.stream_generate(model, tokenizer, ids, max_tokens=max_tokens)]


def mean_logprob(model, ids: list[int], response: list[int]) -> float:
    """Mean log-probability per token of `response` after `ids`, teacher-forced (one forward)."""
    if not response:
        return 0.0
    x = mx.array(ids + response[:-1])[None]
    logits = model(x)[0, len(ids) - 1 :].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logp, mx.array(response)[:, None], axis=-1)
    return float(mx.mean(picked).item())


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--suite", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--category", default=None)
    p.add_argument("--llama-server", default=None, help="a llama-server binary: its responses too")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    llama = None
    if a.llama_server:
        cfg = ServerConfig(gguf_of(a.model), threads=2)
        llama = LlamaServer(HttpServer(check_binary(a.llama_server), cfg))
    suite = load_suite(a.suite)
    if a.category:
        suite = [q for q in suite if q.category in a.category.split(",")]
    model, tokenizer = adaspec.load(a.model)
    rows = []
    for q in suite:
        ids = prompt_ids(tokenizer, q.messages)
        out = {}
        for mode in arithmetic.ARITHMETICS:
            arithmetic.apply(model, mode)
            out[mode] = greedy(model, tokenizer, ids, min(q.max_tokens, a.max_tokens))
        arithmetic.apply(model, "exact")
        if llama is not None:
            reply = llama.complete(ids, min(q.max_tokens, a.max_tokens))
            if reply.tokens is None:
                raise SystemExit(f"{a.llama_server} returned no token ids (needs /completion)")
            out["llama.cpp"] = reply.tokens
        row = {
            "id": q.id,
            "category": q.category,
            "tokens": {m: len(t) for m, t in out.items()},
            "identical": out["exact"] == out["q8"],
            "first_difference": first_difference(out["exact"], out["q8"]),
            "logprob_exact_model": {m: mean_logprob(model, ids, t) for m, t in out.items()},
        }
        if "llama.cpp" in out:
            row["llama_identical"] = out["exact"] == out["llama.cpp"]
            row["llama_first_difference"] = first_difference(out["exact"], out["llama.cpp"])
        rows.append(row)
        lp = row["logprob_exact_model"]
        print(
            f"{q.id:24s} identical={row['identical']!s:5s} first diff={row['first_difference']}"
            f" logp exact {lp['exact']:.3f} q8 {lp['q8']:.3f}"
            + (f" llama.cpp {lp['llama.cpp']:.3f}" if "llama.cpp" in lp else ""),
            flush=True,
        )
    diffs = [r["first_difference"] for r in rows if r["first_difference"] is not None]
    summary = {
        "prompts": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "first_difference_median": statistics.median(diffs) if diffs else None,
        "logprob_exact_model_mean": {
            m: float(np.mean([r["logprob_exact_model"][m] for r in rows]))
            for m in rows[0]["logprob_exact_model"]
        },
    }
    if llama is not None:
        llama.close()
        ldiffs = [
            r["llama_first_difference"] for r in rows if r["llama_first_difference"] is not None
        ]
        summary["llama_identical"] = sum(r["llama_identical"] for r in rows)
        summary["llama_first_difference_median"] = statistics.median(ldiffs) if ldiffs else None
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"date": date.today().isoformat(), "model": a.model, "suite": a.suite,
                 "max_tokens": a.max_tokens, "summary": summary, "prompts": rows},
                f, indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
