"""CPU attention, stock mlx against adaspec's (docs/fast_ops.md, "Cost"): 30 layers' worth of
`scaled_dot_product_attention` on SmolLM2's heads (9 query, 3 kv, dim 64), both in one process
taking turns, best of 8 x 3, per query rows and context length.

    python benchmarks/attention_ab.py [--rows 1,2,4,8,16] [--contexts 50,200,500,1000,2000]
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import time

import adaspec  # noqa: F401  (BLAS and the JIT wrapper before mlx)
import mlx.core as mx

from adaspec.kernels import attention

LAYERS, H, KV, HD = 30, 9, 3, 64


def best_ms(fn, n: int = 8) -> float:
    b = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        b = min(b, time.perf_counter() - t)
    return b * 1e3


def compare(rows: int, context: int) -> tuple[float, float]:
    qs = [mx.random.normal((1, H, rows, HD)) for _ in range(LAYERS)]
    ks = [mx.random.normal((1, KV, context + rows, HD)) for _ in range(LAYERS)]
    mx.eval(qs, ks)
    mask = "causal" if rows > 1 else None
    stock = mx.fast.scaled_dot_product_attention

    def run(f):
        return lambda: mx.eval([f(q, k, k, scale=HD**-0.5, mask=mask) for q, k in zip(qs, ks)])

    a, b = [], []
    for _ in range(3):
        a.append(best_ms(run(stock)))
        b.append(best_ms(run(attention.sdpa)))
    return min(a), min(b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--contexts", default="50,200,500,1000,2000")
    a = p.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    print("| rows | " + " | ".join(f"context {c}" for c in contexts) + " |")
    print("|---" * (len(contexts) + 1) + "|")
    for rows in (int(r) for r in a.rows.split(",")):
        cells = [compare(rows, c) for c in contexts]
        print(f"| {rows} | " + " | ".join(f"{s:.2f} / {f:.2f} ms" for s, f in cells) + " |")


if __name__ == "__main__":
    main()
