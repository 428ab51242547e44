"""`adaspec doctor`: what this machine gives a speculative decoder (BLAS, GFLOP/s, verify cost).

The verify-cost ratio (16-token forward / 1-token forward) bounds every speedup (docs/speed.md).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .settings import Settings
from .settings import get as get_settings

CONTEXT = 200  # cached tokens before the timed forwards
LONG_CONTEXT = 2000  # ... and for the second look at the ops outside the GEMMs
LONG_SIZES = (1, 8, 16)
VERIFY_TOKENS = 16
SIZES = (1, 2, 4, 8, 12, 16, 24, 32)  # forwards timed: a plain step and verifies of 1..31 drafts


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def seconds(fn: Any, repeats: int, warmup: int = 2, pick: Any = statistics.median) -> float:
    """`pick` (median by default) of the wall seconds of `repeats` warm calls of fn"""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(pick(times))


def _median_runs(fns: dict[int, Any], repeats: int, warmup: int = 2) -> dict[int, Any]:
    """Per key, (seconds, seconds of it inside routed GEMMs or None without the router) of
    its run with the median time. The functions take turns, so a change in the machine's
    load falls on every one alike (the ratios between them are the figure), and a GEMM share
    comes from the same run as the time it divides."""
    from .kernels import blas

    for _ in range(warmup):
        for fn in fns.values():
            fn()
    runs: dict[int, list[tuple[float, float | None]]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            g0, t = blas.routed_seconds(), time.perf_counter()
            fn()
            t, g1 = time.perf_counter() - t, blas.routed_seconds()
            runs[k].append((t, None if g0 is None or g1 is None else sum(g1) - sum(g0)))
    return {k: sorted(r, key=lambda x: x[0])[len(r) // 2] for k, r in runs.items()}


def gflops(n: int = 1024, repeats: int = 10) -> float:
    """Measured fp32 matmul throughput: n x n @ n x n, median of `repeats`."""
    import mlx.core as mx

    a = mx.random.normal((n, n), dtype=mx.float32)
    b = mx.random.normal((n, n), dtype=mx.float32)
    mx.eval(a, b)
    return 2 * n**3 / seconds(lambda: mx.eval(a @ b), repeats) / 1e9


def forward_times(
    model: Any,
    repeats: int = 7,
    context: int = CONTEXT,
    cache: list[Any] | None = None,
    sizes: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Warm median milliseconds of forwards of each of SIZES tokens (taking turns) after
    `context` cached tokens, the 16-token forward's cost in 1-token forwards, and per size
    the ratio, GFLOP/s, weight GB/s and (with the routed BLAS) ms inside GEMMs and the ms
    outside them per token row (`per_size`); `sizes` in place of SIZES (1 among them).
    `cache`: an empty prompt cache to time on (a new one if None); it is left holding the
    `context` prefilled tokens only."""
    import mlx.core as mx
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    sizes = sizes or SIZES
    vocab = model.args.vocab_size if hasattr(model, "args") else 1000
    tokens = mx.arange(context + max(sizes))[None] % (min(vocab, 1000) - 10) + 10  # in range
    cache = make_prompt_cache(model) if cache is None else cache
    mx.eval(model(tokens[:, :context], cache=cache))

    def step(n: int) -> Any:
        if can_trim_prompt_cache(cache):

            def run() -> None:
                mx.eval(model(tokens[:, context : context + n], cache=cache))
                trim_prompt_cache(cache, n)
        else:  # recurrent layers cannot be trimmed: time on a fresh copy each call

            def run() -> None:
                fresh = make_prompt_cache(model)
                mx.eval(model(tokens[:, :context], cache=fresh))
                mx.eval(model(tokens[:, context : context + n], cache=fresh))

        return run

    from .kernels import roofline

    runs = _median_runs({n: step(n) for n in sizes}, repeats)
    times = {n: t * 1e3 for n, (t, _) in runs.items()}
    ms = {f"forward_{n}_ms": t for n, t in times.items()}
    verify = ms.get(f"forward_{VERIFY_TOKENS}_ms")  # absent when SIZES leaves it out
    ratio = verify / ms["forward_1_ms"] if verify is not None else None
    by_type = roofline.by_type(step(1), repeats)  # 1-token steps, per stored weight type
    nbytes, elements = roofline.weight_traffic(model)
    gemm = {n: g * 1e3 for n, (_, g) in runs.items() if g is not None}
    per_size = roofline.rows(times, nbytes, elements, gemm or None)
    for r in per_size:
        g = r["gemm_ms"]
        r["other_ms_per_row"] = None if g is None else (r["ms"] - g) / r["tokens"]
    return {
        "context": context,
        **ms,
        "verify_cost_ratio": ratio,
        "weight_bytes": nbytes,
        "fp32_weight_bytes": 4 * elements,
        "per_size": per_size,
        "by_type": by_type,
    }


def _limits(settings: Settings) -> dict[str, Any]:
    from .kernels import roofline

    try:
        return asdict(roofline.measure(settings.cache, threads=os.cpu_count() or 1))
    except OSError as exc:
        return {"error": str(exc)}


def _model_report(name: str, settings: Settings, repeats: int) -> dict[str, Any]:
    from .api import load
    from .kernels import arithmetic, fast_ops
    from .targets.base import layer_list

    t = time.perf_counter()
    model, tokenizer = load(name, settings=settings)
    load_s = time.perf_counter() - t
    fast_ops.install(model)  # adaspec.load did: this changes nothing more
    long = forward_times(model, repeats=repeats, context=LONG_CONTEXT, sizes=LONG_SIZES)
    return {
        "name": name,
        "load_s": load_s,
        "num_layers": len(layer_list(model)),
        "fast_ops": fast_ops.installed(model),
        "arithmetic": arithmetic.of(model),
        **forward_times(model, repeats=repeats),
        "arithmetics": arithmetic.curves(
            model, lambda: forward_times(model, repeats=repeats)["per_size"]
        ),
        "long_context": long,
        "suffix": suffix_report(model, tokenizer, settings),
    }


def suffix_report(model: Any, tokenizer: Any, settings: Settings) -> dict[str, Any]:
    """The `suffix` drafter's index for this model (as `auto` builds it): tokens, memory,
    time to build or load it, and the median time of a draft over its own sequences."""
    from .drafters.arms import make
    from .drafters.base import DraftContext
    from .drafters.suffix import SuffixDrafter
    from .targets.base import target_info

    t = time.perf_counter()
    drafter = make("suffix:context=false", target_info(model, tokenizer), settings)
    build_s = time.perf_counter() - t
    if not isinstance(drafter, SuffixDrafter):
        raise TypeError(f"'suffix' made {type(drafter).__name__}, not the suffix drafter")
    lib = drafter.lib
    times = []
    for index in lib.indexes():
        stream = index.tokens
        for end in range(1000, min(len(stream), 201_000), 1000):
            ctx = stream[max(0, end - 64) : end]
            if (ctx < 0).any():
                continue
            drafter.prefill(ctx.tolist(), DraftContext((), 0))
            t = time.perf_counter()
            drafter.draft(DraftContext((), 16))
            times.append(time.perf_counter() - t)
    return {
        "tokens": sum(len(i) for i in lib.indexes()),
        "online_tokens": lib.online_tokens,
        "bytes": lib.nbytes,
        "build_s": build_s,
        "draft_ms_median": statistics.median(times) * 1e3 if times else None,
    }


def collect(
    model: str | None = None, *, settings: Settings | None = None, repeats: int = 7
) -> dict[str, Any]:
    """Platform, versions, device, BLAS, fp32 GFLOP/s, settings and (with `model`) timings."""
    from .kernels import blas

    settings = settings or get_settings()
    status = blas.ensure()
    import mlx.core as mx

    report: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "adaspec": _version("adaspec"),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "device": str(mx.default_device()),
        "blas": {**asdict(status), "fast": status.fast},
        "gflops_fp32": gflops(),
        "kernel_isa": blas.kernel_isa(),
        "limits": _limits(settings),
        "settings": settings.as_env(),
        "settings_changed": settings.changed(),  # name -> its default
    }
    if model is not None:
        report["model"] = _model_report(model, settings, repeats)
    from .kernels import fast_ops

    report["fast_ops"] = fast_ops.report()  # after the model: its attention modules
    return report


def _outside_gemms(m: dict[str, Any]) -> list[str]:
    """ms outside the GEMMs per token row, per size, at each context timed"""
    out = []
    for t in [x for x in (m, m.get("long_context")) if x]:
        rows = [r for r in t.get("per_size", []) if r.get("other_ms_per_row") is not None]
        if rows:
            cells = ", ".join(f"{r['tokens']}: {r['other_ms_per_row']:.2f}" for r in rows)
            out.append(f"outside GEMMs ms per token row at context {t['context']}: {cells}")
    return out


def _gemm_columns(row: dict[str, Any]) -> str:
    if row.get("gemm_ms") is None:
        return ""
    return f" {row['gemm_ms']:8.1f} {row['ms'] - row['gemm_ms']:9.1f}"


def _type_lines(by_type: list[dict[str, Any]], read_gbs: float) -> list[str]:
    """Per stored weight type, a 1-token step's GEMMs on it against streaming its bytes once"""
    from .kernels import roofline

    if not by_type:
        return []
    out = ["stored types  GEMMs of a 1-token step on each weight type (the kernel's clock)"]
    for r in by_type:
        floor = f", {roofline.floor_ratio(r, read_gbs):.2f}x the floor" if read_gbs > 0 else ""
        out.append(
            f"  {r['type']:<5} {r['mb']:7.0f} MB in {r['ms']:6.2f} ms per 1-token step: "
            f"{r['gbs']:5.1f} GB/s{floor}"
        )
    return out


def _model_lines(m: dict[str, Any], lim: dict[str, Any]) -> list[str]:
    """The report's lines for the model: its weights, forward times and roofline."""
    from .kernels import arithmetic, fast_ops

    lines = [
        f"model         {m['name']} (loaded in {m['load_s']:.2f} s)",
        *fast_ops.model_lines(m.get("fast_ops")),
        f"weights       {m['weight_bytes'] / 1e6:.0f} MB streamed per token "
        + (
            "(fp32)"
            if m["weight_bytes"] == m["fp32_weight_bytes"]
            else f"at their stored bits ({m['fp32_weight_bytes'] / 1e6:.0f} MB as fp32)"
        ),
        f"forward       warm medians at context {m['context']}, ratio to 1 token; GFLOP/s of "
        "the weight matmuls, GB/s of weights read",
        f"verify cost   {m['verify_cost_ratio']:.2f}x a 1-token step "
        f"(speedup <= tokens per step / {m['verify_cost_ratio']:.2f})",
        "tokens     ms  ratio  GFLOP/s  weights GB/s  GEMM ms  other ms",
    ]
    lines += [
        f"{r['tokens']:6d} {r['ms']:6.1f} {r['ratio']:6.2f} {r['gflops']:8.1f} "
        f"{r['weights_gbs']:13.1f}{_gemm_columns(r)}"
        for r in m["per_size"]
    ]
    lines += _outside_gemms(m)
    lines += arithmetic.curve_lines(m.get("arithmetics") or {})
    lines += _type_lines(m.get("by_type") or [], lim.get("read_gbs", 0))
    if lim.get("read_gbs", 0) > 0:
        stream_ms = m["weight_bytes"] / lim["read_gbs"] / 1e6
        lines.append(
            f"roofline      streaming the weights once takes {stream_ms:.1f} ms at "
            f"{lim['read_gbs']:.1f} GB/s; a 1-token step is "
            f"{m['forward_1_ms'] / stream_ms:.2f}x that"
        )
    sx = m.get("suffix")
    if sx:
        draft = sx["draft_ms_median"]
        lines.append(
            f"suffix index  {sx['tokens']} tokens ({sx['online_tokens']} online), "
            f"{sx['bytes'] / 1e6:.1f} MB, ready in {sx['build_s']:.2f} s; a draft "
            + (f"{draft:.3f} ms (median)" if draft is not None else "not timed")
        )
    return lines


def format_report(d: dict[str, Any]) -> str:
    """A human-readable rendering of `collect`'s result."""
    from .kernels import fast_ops

    blas = d["blas"]
    lines = [
        f"platform      {d['platform']} ({d['machine']}, {d['cpu_count']} cpus)",
        f"python        {d['python']}",
        f"versions      adaspec {d['adaspec']}, mlx {d['mlx']}, mlx-lm {d['mlx_lm']}",
        f"device        {d['device']}",
        f"BLAS          {blas['kind']} {blas['library'] or ''}".rstrip(),
        f"fp32 matmul   {d['gflops_fp32']:.1f} GFLOP/s (1024x1024)",
    ]
    if d.get("kernel_isa"):
        lines.append(f"small-M kernel {d['kernel_isa']}")
    lim = d.get("limits", {})
    if "error" in lim:
        lines.append(f"limits        not measured: {lim['error']}")
    elif lim:
        lines.append(
            f"limits        memory {lim['read_gbs']:.1f} GB/s read, {lim['triad_gbs']:.1f} GB/s "
            f"triad; peak {lim['peak_gflops']:.0f} fp32 GFLOP/s ({lim['threads']} threads)"
        )
    lines += fast_ops.report_lines(d.get("fast_ops", {}))
    if blas.get("warning"):
        lines.append(f"  warning: {blas['warning']}")
    if blas.get("note"):
        lines.append(f"  note: {blas['note']}")
    if "model" in d:
        lines += _model_lines(d["model"], lim)
    lines += _distributed_lines(d)
    lines.append("settings")
    changed = d.get("settings_changed", {})
    lines += [
        f"  {k}={v}" + (f"  (default {changed[k] or '(none)'})" if k in changed else "")
        for k, v in d["settings"].items()
    ]
    return "\n".join(lines)


def _distributed_lines(d: dict[str, Any]) -> list[str]:
    """How the target is split when launched over several ranks (ADASPEC_SHARD)."""
    net = d.get("distributed")
    if not net:
        return []
    if net["ranks"] == 1:
        return ["ranks         1 (not started by mlx.launch or mpirun: the target is not sharded)"]
    kind = d["settings"].get("ADASPEC_SHARD", "auto")
    kind = "pipeline" if kind == "auto" else kind
    line = f"ranks         {net['ranks']} ({net['backend']}), target sharded: {kind}"
    m = d.get("model")
    if m and kind == "pipeline" and m.get("num_layers"):
        from .distributed.shard import pipeline_split

        starts, counts = pipeline_split(m["num_layers"], net["ranks"])
        line += (
            " ("
            + ", ".join(
                f"rank {r}: layers {s}-{s + c - 1}" for r, (s, c) in enumerate(zip(starts, counts))
            )
            + ")"
        )
    return [
        line,
        f"network       all_sum round trip {net['round_trip_us_384B']:.0f} us (384 B), "
        f"{net['round_trip_us_36KB']:.0f} us (36 KB)",
    ]
