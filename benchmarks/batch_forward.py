"""Graph nodes and wall time of one batched forward (targets/batch.py) by the number of
requests sharing it, against one request's solo forward, on a real model: attention on the
shared path (the native nodes of kernels/native_layers.py) and, side by side, through mlx-lm's
module once per request ("split").

    python benchmarks/batch_forward.py [--model smollm2-135m] [--levels 1,2,4,8]
        [--rows 1] [--context 200] [--rounds 30] [--json out.json]

Each request holds its own KV cache at a context near `context` (the requests' contexts
differ by a few tokens, as chat requests do) and feeds `rows` token rows per forward; the
cache is trimmed back after each forward. Levels take turns round by round in one process,
so a change in the machine's load falls on all alike; figures are medians. Nodes are counted
as benchmarks/forward_breakdown.py counts them (mlx's DOT export of the forward's graph).
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import io
import json
import os
import re
import statistics
import time
from collections import Counter
from pathlib import Path

import adaspec  # noqa: F401  (loads the BLAS before mlx)
from adaspec.settings import from_env
from adaspec.targets import make_target
from adaspec.targets import batch
from adaspec.targets.batch import forward_rows
from adaspec.targets.loader import load

import mlx.core as mx

SHARED = batch.shared_unsupported
PATHS = ("shared", "split")


def use(path: str) -> None:
    batch.shared_unsupported = SHARED if path == "shared" else (lambda *a: "split")


def graph_nodes(outs: list[mx.array]) -> Counter:
    buf = io.StringIO()
    mx.export_to_dot(buf, *outs)
    names = re.findall(r'label ="([A-Za-z]+)"', buf.getvalue())
    return Counter("Compiled" if n.startswith("Compiled") else n for n in names)


def targets_for(model, n: int, context: int) -> list:
    out = []
    for i in range(n):
        t = make_target(model)
        t.prefill([(j * 7 + i * 13) % 900 + 10 for j in range(context + 3 * i)])
        out.append(t)
    return out


def step(targets, rows: int) -> tuple[float, list[mx.array]]:
    feed = [[(t.offset * 11 + j) % 900 + 10 for j in range(rows)] for t in targets]
    t0 = time.perf_counter()
    got = forward_rows(targets, feed)
    logits = [f.logits for f in got]
    mx.eval(logits, [c.state for t in targets for c in t.cache])
    wall = time.perf_counter() - t0
    for t in targets:
        t.rollback(rows)
    return wall, logits


def solo_step(target, rows: int) -> float:
    feed = [(target.offset * 11 + j) % 900 + 10 for j in range(rows)]
    t0 = time.perf_counter()
    f = target.forward(feed)
    mx.eval(f.logits, [c.state for c in target.cache])
    wall = time.perf_counter() - t0
    target.rollback(rows)
    return wall


def count(batches: dict, rows: int) -> dict:
    """graph nodes by op of one forward, by (path, requests)"""
    nodes = {}
    batch.EVAL_EACH_LAYER = False  # one lazy graph to count
    for path in PATHS:
        use(path)
        for n, ts in batches.items():
            got = forward_rows(ts, [[10 + j for j in range(rows)] for _ in ts])
            nodes[path, n] = graph_nodes([f.logits for f in got])
            mx.eval([f.logits for f in got])
            for t in ts:
                t.rollback(rows)
    batch.EVAL_EACH_LAYER = True
    return nodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--levels", default="1,2,4,8")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    model, _ = load(a.model, settings=from_env(dict(os.environ)))
    batches = {n: targets_for(model, n, a.context) for n in levels}
    solo = targets_for(model, 1, a.context)[0]
    nodes = count(batches, a.rows)
    walls: dict = {k: [] for k in nodes}
    walls["solo"] = []
    load0 = os.getloadavg()[0]
    for r in range(a.rounds + 2):
        for path in PATHS:
            use(path)
            for n in levels:
                w, _ = step(batches[n], a.rows)
                if r >= 2:
                    walls[path, n].append(w)
        w = solo_step(solo, a.rows)
        if r >= 2:
            walls["solo"].append(w)
    med = {k: statistics.median(v) * 1e3 for k, v in walls.items()}
    print(f"{a.model}, {a.rows} row(s) per request, context ~{a.context}, {a.rounds} rounds")
    print("| requests | path | nodes | nodes/request | forward ms | vs solo |")
    print("|---|---|---|---|---|---|")
    for n in levels:
        for path in PATHS:
            total = sum(nodes[path, n].values())
            print(
                f"| {n} | {path} | {total} | {total / n:.0f} | {med[path, n]:.2f} | "
                f"{med[path, n] / med['solo']:.2f}x |"
            )
    print(
        f"solo forward {med['solo']:.2f} ms; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    for path in PATHS:
        for n in levels:
            by_op = json.dumps(dict(nodes[path, n].most_common()))
            print(f"nodes by op, {path}, {n} request(s): {by_op}")
    if a.json:
        out = {"model": a.model, "rows": a.rows, "context": a.context}
        out["median_ms"] = {"/".join(map(str, k)) if isinstance(k, tuple) else k: v
                            for k, v in med.items()}  # fmt: skip
        out["nodes"] = {f"{p}/{n}": dict(c) for (p, n), c in nodes.items()}
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
