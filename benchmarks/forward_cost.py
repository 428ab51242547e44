"""Forward cost per number of token rows, against this machine's limits: ms per warm forward,
its ratio to a 1-token step, GFLOP/s of the weight matmuls, GB/s of weights streamed and the ms
inside GEMMs (the rest is mlx's other ops and their dispatch), beside the measured memory
bandwidth and peak FMA rate (docs/benchmarks.md, "Roofline").

    python benchmarks/forward_cost.py [--model smollm2-135m] [--context 200]
        [--sizes 1,2,4,8,12,16,24,32] [--repeats 9] [--weights fp32|bf16|q4] [--json out.json]
        [--arithmetic exact,q8]   # one table per arithmetic, then the curves side by side
    (--weights bf16: the small-row GEMMs read bf16 shadows of the weight matrices, as a
    draft model with weights=bf16 does; the GB/s column still counts fp32 bytes; --weights q4:
    4-bit copies of a GGUF model's wider stored weights, as a draft model's weights=q4 reads)
    ADASPEC_BLAS=openblas python benchmarks/forward_cost.py      # another BLAS
    ADASPEC_KERNEL_ISA=avx2 python benchmarks/forward_cost.py    # the AVX2 kernel on AVX-512
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import json
import os
from dataclasses import asdict
from datetime import date

import adaspec  # noqa: F401  (loads the BLAS before mlx)

from adaspec import doctor
from adaspec.kernels import arithmetic, blas, fast_ops, requant, roofline, shadow
from adaspec.settings import from_env
from adaspec.settings import get as get_settings
from adaspec.targets.loader import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=doctor.CONTEXT)
    p.add_argument("--sizes", default=",".join(map(str, doctor.SIZES)))
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--weights", choices=("fp32", "bf16", "q4"), default="fp32")
    p.add_argument(
        "--stored",
        choices=("auto", "on", "off"),
        default=None,
        help="GGUF weights at their stored bits, or expanded to fp32 (ADASPEC_STORED_WEIGHTS)",
    )
    p.add_argument("--json", default=None, help="write the numbers here")
    p.add_argument(
        "--arithmetic",
        default="exact",
        help="comma-separated: exact, q8 (ADASPEC_ARITHMETIC); several print side by side",
    )
    a = p.parse_args()
    modes = a.arithmetic.split(",")
    if not modes or any(m not in arithmetic.ARITHMETICS for m in modes):
        p.error(f"--arithmetic {a.arithmetic}: accepted: {', '.join(arithmetic.ARITHMETICS)}")
    sizes = tuple(int(s) for s in a.sizes.split(","))
    if 1 not in sizes:
        p.error(f"--sizes {a.sizes}: must include 1 (the ratios are to a 1-token step)")
    doctor.SIZES = sizes
    env = {"ADASPEC_STORED_WEIGHTS": a.stored} if a.stored else {}
    settings = from_env({**os.environ, **env})
    model, _ = load(a.model, settings=settings)
    if a.weights == "q4":
        requant.requantize(model)
    stored_mb = model.adaspec_stored.nbytes / 1e6 if hasattr(model, "adaspec_stored") else 0
    fast_ops.install(model)
    shadows = shadow.shadow_model(model) if a.weights == "bf16" else None
    limits = roofline.measure(get_settings().cache, threads=os.cpu_count() or 1)
    by_mode = {}
    for mode in modes:
        arithmetic.apply(model, mode)
        by_mode[mode] = doctor.forward_times(model, repeats=a.repeats, context=a.context)
        by_mode[mode]["kernel"] = arithmetic.describe(model)
        report(a, by_mode[mode], limits, stored_mb, shadows, mode)
    if len(modes) > 1:
        side_by_side(by_mode)
    if a.json:
        st = blas.status()
        first = by_mode[modes[0]]
        out = {
            "date": date.today().isoformat(),
            "model": a.model,
            "context": a.context,
            "blas": st.kind,
            "kernel_isa": blas.kernel_isa(),
            "weights": a.weights,
            "stored_mb": stored_mb,
            "limits": asdict(limits),
            "arithmetic": modes[0],
            **first,
            "by_arithmetic": by_mode,
        }
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


def side_by_side(by_mode: dict) -> None:
    modes = list(by_mode)
    print("| tokens | " + " | ".join(f"{m} ms (x 1 row)" for m in modes) + " |")
    print("|---|" + "---|" * len(modes))
    rows = [{r["tokens"]: r for r in by_mode[m]["per_size"]} for m in modes]
    for n in rows[0]:
        cells = " | ".join(f"{r[n]['ms']:.1f} ({r[n]['ratio']:.2f})" for r in rows)
        print(f"| {n} | {cells} |")


def report(a, times: dict, limits, stored_mb: float, shadows, mode: str) -> None:
    st = blas.status()
    stream_ms = times["weight_bytes"] / limits.read_gbs / 1e6
    print(
        f"{a.model}, arithmetic {times['kernel']}, context {a.context}, BLAS {st.kind}, "
        f"kernel {blas.kernel_isa()}, weights {a.weights}, "
        + (f"stored bits ({stored_mb:.0f} MB)" if stored_mb else "fp32 expansion")
        + (f" ({shadows.count} matrices, {shadows.nbytes / 1e6:.0f} MB of bf16)" if shadows else "")
    )
    print(
        f"limits: memory {limits.read_gbs:.1f} GB/s read, {limits.triad_gbs:.1f} GB/s triad; "
        f"peak {limits.peak_gflops:.0f} GFLOP/s on {limits.threads} threads; weights "
        f"{times['weight_bytes'] / 1e6:.0f} MB, streamed once in {stream_ms:.1f} ms"
    )
    print(
        "| tokens | ms | ratio to 1 | GFLOP/s | weights GB/s | GEMM ms | other ms |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in times["per_size"]:
        g = r["gemm_ms"]
        split = "- | -" if g is None else f"{g:.1f} | {r['ms'] - g:.1f}"
        print(
            f"| {r['tokens']} | {r['ms']:.1f} | {r['ratio']:.2f} | {r['gflops']:.1f} | "
            f"{r['weights_gbs']:.1f} | {split} |"
        )
    print(f"1-token step / streaming the weights once: {times['forward_1_ms'] / stream_ms:.2f}x")
    if times["by_type"]:
        print("| stored type | MB per step | GEMM ms per 1-token step | GB/s | x the floor |")
        print("|---|---|---|---|---|")
    for r in times["by_type"]:
        floor = roofline.floor_ratio(r, limits.read_gbs)
        print(f"| {r['type']} | {r['mb']:.0f} | {r['ms']:.2f} | {r['gbs']:.1f} | {floor:.2f} |")


if __name__ == "__main__":
    main()
