"""Where a forward's time goes outside the GEMMs: graph building in Python, mlx's scheduling of
the graph's nodes, the GEMMs, mlx's other ops, and the waits between threads, per forward of a
real model at a given context (docs/fast_ops.md, "Cost").

    python benchmarks/forward_breakdown.py [--model smollm2-135m] [--contexts 200,2000]
        [--rows 1] [--rounds 40] [--variants twins,no-stack,no-native,stock-linear,stock]
        [--json out.json]

Each forward appends `rows` tokens at a new position (16 positions in turn, then the cache is
trimmed back), as decoding does. Variants take turns forward by forward in one process, so a
change in the machine's load falls on all alike: `twins` as fast_ops.install leaves the model,
`no-stack` as `twins` with each decoder layer's node made by its own call (not the model's
layers in one call, kernels/native_stack.py), `no-native` as `twins` without adaspec's native
primitives (kernels/native.py: a decoder layer, attention, the MLP's gate and up projections
in one node each; mlx-lm's code on the layer twins instead), `stock-linear` with mlx's
nn.Linear in place of the Linear twin, `stock` with every twin and the attention path replaced
by stock mlx-lm modules (mlx's JIT kernels stay ours). Figures are medians over rounds; CPU
times come from the kernel's per-thread accounting (schedstat), which other jobs on the
machine do not inflate, unlike wall times.
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import io
import json
import os
import re
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import adaspec  # noqa: F401  (loads the BLAS before mlx)
from adaspec.kernels import attention, blas, fast_ops, layers, native_layers
from adaspec.settings import from_env
from adaspec.targets.loader import load

import mlx.core as mx

POSITIONS = 16  # more than layers._ANGLES: each forward's RoPE angles are new, as in decoding


def thread_cpu() -> dict[int, float]:
    """seconds on a CPU so far, per thread of this process"""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except OSError:
            pass
    return out


def stream_thread() -> int:
    """mlx's CPU stream thread: the one that runs an elementwise op (the routed kernel's
    worker thread, which may spin after a GEMM, is idle by then)"""
    time.sleep(0.1)
    x = mx.ones((1 << 22,))
    mx.eval(x)
    before = thread_cpu()
    for _ in range(5):
        mx.eval(mx.exp(x))
    after = thread_cpu()
    me = threading.get_native_id()
    return max((t for t in after if t != me), key=lambda t: after[t] - before.get(t, 0))


def graph_nodes(out: mx.array) -> Counter:
    buf = io.StringIO()
    mx.export_to_dot(buf, out)
    names = re.findall(r'label ="([A-Za-z]+)"', buf.getvalue())
    return Counter("Compiled" if n.startswith("Compiled") else n for n in names)


_NATIVE = attention.native_core


def _no_native(*args):
    return None


class Variants:
    """Switch one model between its twins and stock modules (the same arrays throughout)."""

    def __init__(self, model):
        from mlx_lm.models import base

        self.model = model
        self.module = sys.modules[type(model).__module__]
        self.routed = self.module.scaled_dot_product_attention
        self.stock_sdpa = base.scaled_dot_product_attention
        self.swaps = []
        for _, parent in model.named_modules():
            for key, child in parent.items():
                ref = layers.stock(child)
                if ref is not None:
                    self.swaps.append((parent, key, child, ref))

    def use(self, name: str) -> None:
        attention.native_core = _no_native if name == "no-native" else _NATIVE
        if name in ("no-native", "stock"):
            native_layers.uninstall(self.model)
        else:
            native_layers.install(self.model)
        inner = self.model.model
        if name == "no-stack" and "_native" in type(inner).__dict__:
            inner.__class__ = type(inner)._native
        stock = name == "stock"
        self.module.scaled_dot_product_attention = self.stock_sdpa if stock else self.routed
        for parent, key, twin, ref in self.swaps:
            linear = isinstance(twin, layers.ExactLinear)
            parent[key] = ref if stock or (name == "stock-linear" and linear) else twin


def measure(model, cache, tokens, context, rows: int, step: int, stream_tid: int) -> dict:
    """one forward of `rows` tokens at position context + step * rows, split in its parts"""
    me = threading.get_native_id()
    x = tokens[:, context + step * rows : context + (step + 1) * rows]
    g0, c0, w0 = blas.routed_seconds(), thread_cpu(), time.perf_counter()
    out = model(x, cache=cache)
    c1, w1 = thread_cpu(), time.perf_counter()
    mx.eval(out)
    c2, w2, g2 = thread_cpu(), time.perf_counter(), blas.routed_seconds()
    stream = c2.get(stream_tid, 0) - c1.get(stream_tid, 0)
    others = [c2[t] - c1.get(t, 0) for t in c2 if t not in (me, stream_tid)]
    gemm = (g2[0] - g0[0]) + (g2[1] - g0[1]) if g0 and g2 else float("nan")
    return {
        "build_cpu_ms": (c1[me] - c0[me]) * 1e3,
        "eval_main_cpu_ms": (c2[me] - c1[me]) * 1e3,
        "eval_stream_cpu_ms": stream * 1e3,
        "eval_other_threads_cpu_ms": sum(others) * 1e3,  # the routed kernel's worker
        "gemm_ms": gemm * 1e3,
        "stream_other_ops_ms": (stream - gemm) * 1e3,
        "build_wall_ms": (w1 - w0) * 1e3,
        "eval_wall_ms": (w2 - w1) * 1e3,
    }


def run(model, variants: Variants, names, context: int, rows: int, rounds: int) -> dict:
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    tokens = mx.arange(context + POSITIONS * rows)[None] * 7 % 900 + 10
    cache = make_prompt_cache(model)
    mx.eval(model(tokens[:, :context], cache=cache))
    samples = {n: [] for n in names}
    nodes, stream_tid = {}, stream_thread()
    for r in range(rounds + 2):  # two warm-up rounds
        for name in names:
            variants.use(name)
            for step in range(POSITIONS):
                if r == 1 and step == 0:  # once the variant's one-off nodes are evaluated
                    x = tokens[:, context : context + rows]
                    nodes[name] = graph_nodes(model(x, cache=cache))
                    trim_prompt_cache(cache, rows)
                m = measure(model, cache, tokens, context, rows, step, stream_tid)
                if r >= 2:
                    samples[name].append(m)
            trim_prompt_cache(cache, POSITIONS * rows)
    variants.use("twins")
    result = {}
    for name in names:
        med = {k: statistics.median(s[k] for s in samples[name]) for k in samples[name][0]}
        result[name] = {"nodes": sum(nodes[name].values()), "by_op": dict(nodes[name]), **med}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", default="200,2000")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--variants", default="twins,no-stack,no-native,stock-linear,stock")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    names = a.variants.split(",")
    unknown = set(names) - {"twins", "no-stack", "no-native", "stock-linear", "stock"}
    if unknown:
        accepted = "twins, no-stack, no-native, stock-linear, stock"
        p.error(f"--variants {a.variants}: accepted {accepted}")
    model, _ = load(a.model, settings=from_env(dict(os.environ)))
    fast_ops.install(model)
    variants = Variants(model)
    if not variants.swaps:
        p.error("the fast paths are off here (ADASPEC_FAST_OPS, platform): nothing to compare")
    out = {"model": a.model, "rows": a.rows, "load_average_before": os.getloadavg()[0]}
    keys = (
        "nodes", "build_cpu_ms", "eval_main_cpu_ms", "eval_stream_cpu_ms", "gemm_ms",
        "stream_other_ops_ms", "eval_other_threads_cpu_ms", "build_wall_ms", "eval_wall_ms",
    )  # fmt: skip
    for context in (int(c) for c in a.contexts.split(",")):
        res = run(model, variants, names, context, a.rows, a.rounds)
        out[str(context)] = res
        print(f"context {context}, {a.rows} row(s), medians of {a.rounds * POSITIONS} forwards")
        print("| | " + " | ".join(names) + " |\n|---" + "|---" * len(names) + "|")
        for k in keys:
            cells = [f"{res[n][k]:.0f}" if k == "nodes" else f"{res[n][k]:.2f}" for n in names]
            print(f"| {k} | " + " | ".join(cells) + " |")
        print("nodes by op (twins): " + json.dumps(res[names[0]]["by_op"]), flush=True)
    out["load_average_after"] = os.getloadavg()[0]
    print(f"load average {out['load_average_before']:.1f} -> {out['load_average_after']:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
