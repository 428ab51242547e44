"""What the ops outside the GEMMs cost: each non-GEMM op of a llama-style decoder layer, timed
alone (best of 9) for a forward's worth of layers at M token rows (docs/benchmarks.md, "Roofline");
with the fast paths on (docs/fast_ops.md), their rows ("... fast") beside stock mlx's.

    python benchmarks/forward_ops.py [--sizes 1,16,32] [--layers 30] [--context 200]
    ADASPEC_FAST_OPS=off python benchmarks/forward_ops.py   # SwiGLU on stock mlx's JIT kernel

Shapes default to SmolLM2-135M's (hidden 576, 9 heads of 64, 3 kv heads, intermediate 1536).
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import adaspec  # noqa: F401  (loads the BLAS before mlx)
from adaspec import doctor
from adaspec.kernels import attention, softmax
from adaspec.kernels import layers as twins

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

D, H, KV, HD, F = 576, 9, 3, 64, 1536


def _ms(fn) -> float:
    """best of 9: the op's own cost, which other jobs on the machine only add to"""
    return doctor.seconds(fn, 9, pick=min) * 1e3


def ops(m: int, layers: int, context: int) -> dict[str, float]:
    """ms of each op over `layers` layers, one graph per op, at m token rows"""
    rnd = mx.random.normal
    xs = [rnd((1, m, D)) for _ in range(layers)]
    gs = [rnd((1, m, F)) for _ in range(layers)]
    qs = [rnd((1, H, m, HD)) for _ in range(layers)]
    ks = [rnd((1, KV, context + m, HD)) for _ in range(layers)]
    vs = [rnd((1, KV, context + m, HD)) for _ in range(layers)]
    scores = [rnd((1, H, m, context + m)) for _ in range(layers)]
    mx.eval(xs, gs, qs, ks, vs, scores)
    w, rope, mask = mx.ones((D,)), nn.RoPE(HD, base=100000), "causal" if m > 1 else None
    sdpa = mx.fast.scaled_dot_product_attention
    fast = fast_ops(m, layers, context, (xs, qs, ks, vs, scores), mask)
    return {
        **fast,
        "attention (sdpa)": _ms(
            lambda: mx.eval(
                [sdpa(q, k, v, scale=HD**-0.5, mask=mask) for q, k, v in zip(qs, ks, vs)]
            )
        ),
        "of it, softmax": _ms(lambda: mx.eval([mx.softmax(s, -1, precise=True) for s in scores])),
        "swiglu": _ms(lambda: mx.eval([swiglu(g, g) for g in gs])),
        "rope q, k": _ms(
            lambda: mx.eval(
                [rope(q, offset=context) for q in qs]
                + [rope(k[:, :, :m], offset=context) for k in ks]
            )
        ),
        "rms_norm x2": _ms(lambda: mx.eval([mx.fast.rms_norm(x, w, 1e-5) for x in xs + xs])),
        "adds x2, reshape": _ms(
            lambda: mx.eval(
                [x + x for x in xs + xs] + [mx.contiguous(q.transpose(0, 2, 1, 3)) for q in qs]
            )
        ),
    }


def fast_ops(m: int, n_layers: int, context: int, arrays, mask) -> dict[str, float]:
    """the fast paths' twins of the rows below, where they are enabled"""
    if not attention.enabled():
        return {}
    xs, qs, ks, vs, scores = arrays
    rope, norm = twins.ExactRoPE(HD, False, 100000.0, 1.0), twins.ExactRMSNorm(D, 1e-5)
    sdpa = attention.sdpa
    return {
        "attention (sdpa) fast": _ms(
            lambda: mx.eval(
                [sdpa(q, k, v, scale=HD**-0.5, mask=mask) for q, k, v in zip(qs, ks, vs)]
            )
        ),
        "of it, softmax fast": _ms(lambda: mx.eval([softmax.softmax(s) for s in scores])),
        "rope q, k fast": _ms(
            lambda: mx.eval(
                [rope(q, offset=context) for q in qs]
                + [rope(k[:, :, :m], offset=context) for k in ks]
            )
        ),
        "rms_norm x2 fast": _ms(lambda: mx.eval([norm(x) for x in xs + xs])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,16,32")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--context", type=int, default=200)
    a = p.parse_args()
    try:
        sizes = [int(s) for s in a.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes {a.sizes}: accepted comma-separated token-row counts such as 1,16,32")
    table = {m: ops(m, a.layers, a.context) for m in sizes}
    print(
        f"| op ({a.layers} layers, context {a.context}) | "
        + " | ".join(f"M = {m}" for m in sizes)
        + " |"
    )
    print("|---" * (len(sizes) + 1) + "|")
    for name in table[sizes[0]]:
        print(f"| {name} | " + " | ".join(f"{table[m][name]:.1f} ms" for m in sizes) + " |")


if __name__ == "__main__":
    main()
