"""Numbers for docs/benchmarks.md "Real models and BLAS": BLAS choices, load times, perplexity.

python benchmarks/real_models.py blas --rounds 3      # doctor per BLAS, fresh processes
    [--kinds routed,mkl,openblas,off]
python benchmarks/real_models.py load                 # cold and warm smollm2-135m load
python benchmarks/real_models.py ppl --tokens 2048    # Qwen pair on argparse.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import adaspec  # noqa: F401  (loads the fast BLAS before mlx)
from adaspec.targets.loader import load as load_model

CHILD_LOAD = """
import time, json, adaspec
t = time.perf_counter()
from adaspec.targets.loader import load
load("smollm2-135m")
print(json.dumps({"load_s": time.perf_counter() - t}))
"""


def _child(args: list[str], **env: str) -> dict:
    environ = {**os.environ, **env}
    out = subprocess.run(args, capture_output=True, text=True, check=True, env=environ)
    return json.loads(out.stdout)


SIZES = (1, 4, 8, 16)


def blas(rounds: int, model: str, kinds: tuple[str, ...]) -> None:
    rows: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in kinds:  # interleaved, so background load hits every choice alike
            d = _child(["adaspec", "doctor", "--json", "--model", model], ADASPEC_BLAS=kind)
            rows[kind].append(d)
            m = d["model"]
            times = " ".join(f"{n}-tok {m[f'forward_{n}_ms']:6.1f}" for n in SIZES)
            print(
                f"round {r} {kind:8s} {d['blas']['kind']:9s} {d['gflops_fp32']:7.1f} GFLOP/s "
                f"{times} ms ratio {m['verify_cost_ratio']:.2f} load1 {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    cols = " | ".join(f"{n}-token ms" for n in SIZES)
    print(f"\n| ADASPEC_BLAS | fp32 GFLOP/s | {cols} | 16/1 ratio |")
    print("|---" * (3 + len(SIZES)) + "|")
    for kind, ds in rows.items():
        models = [d["model"] for d in ds]
        times = " | ".join(
            f"{statistics.median(m[f'forward_{n}_ms'] for m in models):.1f}" for n in SIZES
        )
        print(
            f"| {kind} | {statistics.median(d['gflops_fp32'] for d in ds):.1f} | {times} "
            f"| {statistics.median(m['verify_cost_ratio'] for m in models):.2f} |"
        )


def load(rounds: int) -> None:
    for r in range(rounds):
        with tempfile.TemporaryDirectory() as cache:
            cold = _child([sys.executable, "-c", CHILD_LOAD], ADASPEC_CACHE=cache)["load_s"]
            warm = _child([sys.executable, "-c", CHILD_LOAD], ADASPEC_CACHE=cache)["load_s"]
        print(f"round {r}: cold {cold:.2f} s, warm {warm:.2f} s (load1 {os.getloadavg()[0]:.2f})")


def perplexity(n_tokens: int, window: int) -> None:
    import argparse as stdlib_argparse

    import mlx.core as mx

    source = open(stdlib_argparse.__file__, encoding="utf-8").read()
    greedy = {}
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        model, tok = load_model(name)
        ids = tok.encode(source)[:n_tokens]
        nll, count, picks = 0.0, 0, []
        t = time.perf_counter()
        for start in range(0, len(ids) - 1, window):
            chunk = mx.array([ids[start : start + window + 1]])
            logits = model(chunk[:, :-1]).astype(mx.float32)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nll += -mx.take_along_axis(logp, chunk[:, 1:, None], axis=-1).sum().item()
            count += chunk.shape[1] - 1
            picks += mx.argmax(logits, axis=-1)[0].tolist()
        greedy[name] = picks
        print(
            f"{name}: perplexity {math.exp(nll / count):.3f} over {count} tokens of "
            f"{stdlib_argparse.__file__} (windows of {window}, {time.perf_counter() - t:.0f} s)"
        )
        del model
    a, b = greedy.values()
    same = sum(x == y for x, y in zip(a, b)) / len(a)
    print(f"top-1 agreement 0.5B vs 1.5B: {same:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["blas", "load", "ppl"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--kinds", default="routed,mkl,openblas,off", help="ADASPEC_BLAS choices")
    a = p.parse_args()
    if a.what == "blas":
        blas(a.rounds, a.model, tuple(a.kinds.split(",")))
    elif a.what == "load":
        load(a.rounds)
    else:
        perplexity(a.tokens, a.window)


if __name__ == "__main__":
    main()
