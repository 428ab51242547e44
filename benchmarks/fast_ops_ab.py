"""Forward cost with ADASPEC_FAST_OPS off and on (or any variable at two values, --env):
benchmarks/forward_cost.py run in fresh processes, alternately, per context; medians over
rounds (docs/fast_ops.md, "Cost").

    python benchmarks/fast_ops_ab.py [--model smollm2-135m] [--contexts 200,2000]
        [--sizes 1,8,16] [--rounds 3] [--repeats 9] [--json out.json]
        [--env NAME=OFF,ON]    # default ADASPEC_FAST_OPS=off,on
    python benchmarks/fast_ops_ab.py --env GLIBC_TUNABLES=,glibc.malloc.tcache_count=1000

The JIT kernels of one process cannot be switched off once loaded (nor glibc's tunables set
after it starts), so the two sides run in separate processes, taking turns (a change in the
machine's load falls on both alike).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def run(model: str, context: int, sizes: str, repeats: int, var: tuple[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "cost.json"
        env = {**os.environ, var[0]: var[1]}
        cmd = [sys.executable, str(HERE / "forward_cost.py"), "--model", model]
        cmd += ["--context", str(context), "--sizes", sizes, "--repeats", str(repeats)]
        subprocess.run([*cmd, "--json", str(out)], env=env, check=True, capture_output=True)
        return json.loads(out.read_text())


def medians(runs: list[dict]) -> dict[int, dict[str, float | None]]:
    by_size: dict[int, dict[str, list[float]]] = {}
    for r in runs:
        for row in r["per_size"]:
            cell = by_size.setdefault(row["tokens"], {"ms": [], "gemm_ms": []})
            cell["ms"].append(row["ms"])
            if row["gemm_ms"] is not None:
                cell["gemm_ms"].append(row["gemm_ms"])
    return {
        m: {k: statistics.median(v) if v else None for k, v in cell.items()}
        for m, cell in by_size.items()
    }


def table(context: int, off: dict, on: dict) -> list[str]:
    lines = [
        f"context {context}",
        "| rows | ms off | ms on | ratio to 1 row off | on | outside GEMMs ms off | on "
        "| per row off | per row on |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in sorted(off):
        a, b = off[m], on[m]
        ga, gb = a["gemm_ms"], b["gemm_ms"]
        oa = None if ga is None else a["ms"] - ga
        ob = None if gb is None else b["ms"] - gb

        def f(x: float | None, nd: int = 1) -> str:
            return "-" if x is None else f"{x:.{nd}f}"

        lines.append(
            f"| {m} | {f(a['ms'])} | {f(b['ms'])} | {a['ms'] / off[1]['ms']:.2f} | "
            f"{b['ms'] / on[1]['ms']:.2f} | {f(oa)} | {f(ob)} | "
            f"{f(oa and oa / m, 2)} | {f(ob and ob / m, 2)} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", default="200,2000")
    p.add_argument("--sizes", default="1,8,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", default=None)
    p.add_argument("--env", default="ADASPEC_FAST_OPS=off,on", help="NAME=OFF,ON")
    a = p.parse_args()
    if "1" not in a.sizes.split(","):
        p.error(f"--sizes {a.sizes}: must include 1")
    name, _, values = a.env.partition("=")
    if not name or values.count(",") != 1:
        p.error(f"--env {a.env!r}: accepted: NAME=OFF,ON (one comma; a side may be empty)")
    sides = {False: (name, values.split(",")[0]), True: (name, values.split(",")[1])}
    print(f"off: {name}={sides[False][1]!r}, on: {name}={sides[True][1]!r}")
    result: dict = {"env": a.env, "load_average_before": os.getloadavg()[0]}
    for context in (int(c) for c in a.contexts.split(",")):
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(a.rounds):
            for fast in (False, True):
                runs[fast].append(run(a.model, context, a.sizes, a.repeats, sides[fast]))
        off, on = medians(runs[False]), medians(runs[True])
        print("\n".join(table(context, off, on)), flush=True)
        result[str(context)] = {
            "off": off,
            "on": on,
            "runs": {"off": runs[False], "on": runs[True]},
        }
    result["load_average_after"] = os.getloadavg()[0]
    print(f"load average {result['load_average_before']:.1f} -> {result['load_average_after']:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, **result}, indent=1))


if __name__ == "__main__":
    main()
