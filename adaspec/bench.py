"""Side-by-side benchmark: mlx-lm's own AR and adaspec, interleaved in one process."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .bench_peer import PeerConfig, peer_block, peer_fields, sampler, setup_peer
from .errors import GenerationArgumentError
from .prompting import prompt_ids


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    grounded: bool
    messages: list[dict]
    max_tokens: int


def load_suite(path: str | Path) -> list[Prompt]:
    p = Path(path)
    if not p.is_file():
        raise GenerationArgumentError(f"suite {str(p)!r} does not exist; accepted: a .jsonl file")
    out = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            out.append(
                Prompt(
                    r["id"],
                    r.get("category", "default"),
                    bool(r.get("grounded")),
                    r["messages"],
                    int(r.get("max_tokens", 128)),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise GenerationArgumentError(
                f"{p}:{i} is not a prompt record ({exc!r}); accepted: JSON with id, messages"
            ) from None
    if not out:
        raise GenerationArgumentError(f"suite {str(p)!r} has no prompts")
    return out


@dataclass
class Run:
    """One timed generation: tokens, end-to-end and post-first-step decode rates."""

    tokens: list[int]
    e2e_s: float
    decode_tok_s: float
    stats: dict = field(default_factory=dict)


def timed(stream: Iterable[Any]) -> Run:
    """Consume a response stream. Decode rate counts the tokens after the first step, over the
    time after the first step, so AR (1 token per step) and speculation are measured alike."""
    t0 = time.perf_counter()
    tokens: list[int] = []
    t_first, first_step_tokens, last = None, 0, None
    for r in stream:
        tokens.append(r.token)
        last = r
        if t_first is None and (getattr(r, "step", None) is not None or not hasattr(r, "step")):
            t_first, first_step_tokens = time.perf_counter(), len(tokens)
    t_end = time.perf_counter()
    if last is not None and last.finish_reason == "stop":
        tokens = tokens[:-1] if last.text == "" else tokens  # EOS is not output
    n_after = len(tokens) - first_step_tokens
    dt = t_end - (t_first or t_end)
    stats = last.stats.summary() if getattr(last, "stats", None) is not None else {}
    return Run(tokens, t_end - t0, n_after / dt if dt > 0 and n_after > 0 else 0.0, stats)


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


Runner = Callable[[list[int], int], Run]


def bench_prompt(
    prompt: Prompt,
    runners: dict[str, Runner],
    ids: list[int],
    repeats: int,
    peer_k: int = 0,
) -> dict:
    """Time every runner ("ar", "spec", optionally "peer") on one prompt, interleaved A B C A B C
    so drift hits all alike; medians over the repeats."""
    runs: dict[str, list[Run]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            runs[name].append(run(ids, prompt.max_tokens))
    ar, spec = runs["ar"], runs["spec"]
    ar_tps = _median([r.decode_tok_s for r in ar])
    sp_tps = _median([r.decode_tok_s for r in spec])
    ar_e2e = _median([len(r.tokens) / r.e2e_s for r in ar])
    sp_e2e = _median([len(r.tokens) / r.e2e_s for r in spec])
    s = spec[-1].stats
    ref, got = ar[0].tokens, spec[0].tokens
    diverge = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    record = {
        "id": prompt.id,
        "category": prompt.category,
        "grounded": prompt.grounded,
        "prompt_tokens": len(ids),
        "tokens": len(got),
        "ar_tok_s": round(ar_tps, 2),
        "spec_tok_s": round(sp_tps, 2),
        "speedup": round(sp_tps / ar_tps, 4) if ar_tps else 0.0,
        "ar_e2e_tok_s": round(ar_e2e, 2),
        "spec_e2e_tok_s": round(sp_e2e, 2),
        "e2e_speedup": round(sp_e2e / ar_e2e, 4) if ar_e2e else 0.0,
        "tau": s.get("tau", 0.0),
        "acceptance_rate": s.get("acceptance_rate", 0.0),
        "acceptance_by_position": s.get("acceptance_by_position", []),
        "floored_fraction": s.get("floored_fraction", 0.0),
        "identical": ref == got,
        "first_divergence": diverge if ref != got else None,
        "repeats": repeats,
    }
    if "peer" in runs:
        record.update(peer_fields(runs["peer"], ar, spec, peer_k))
    return record


def summarize(records: list[dict]) -> dict:
    def block(rs: list[dict]) -> dict:
        return {
            "prompts": len(rs),
            "median_speedup": round(_median([r["speedup"] for r in rs]), 4),
            "min_speedup": round(min((r["speedup"] for r in rs), default=0.0), 4),
            "median_e2e_speedup": round(_median([r["e2e_speedup"] for r in rs]), 4),
            "mean_tau": round(statistics.fmean([r["tau"] for r in rs]), 4) if rs else 0.0,
            "floored_fraction": round(_median([r["floored_fraction"] for r in rs]), 4),
            "identical": sum(r["identical"] for r in rs),
            **peer_block(rs),
        }

    cats = sorted({r["category"] for r in records})
    return {
        "all": block(records),
        "grounded": block([r for r in records if r["grounded"]]),
        "open": block([r for r in records if not r["grounded"]]),
        "by_category": {c: block([r for r in records if r["category"] == c]) for c in cats},
    }


def markdown(records: list[dict], summary: dict) -> str:
    peer = "median_peer_speedup" in summary["all"]
    head = "| category | prompts | AR tok/s | spec tok/s | speedup (median) | min | tau | floored "
    head += "| identical |" + (" mlx-lm spec tok/s | peer vs AR | spec vs peer | peer tau |" * peer)
    lines = [head, "|---" * (9 + 4 * peer) + "|"]

    def peer_cols(b: dict, tps: str) -> str:
        if not peer:
            return ""
        return (
            f" {tps} | {b['median_peer_speedup']:.2f}x | {b['median_spec_vs_peer']:.2f}x "
            f"| {b['peer_mean_tau']:.2f} |"
        )

    for cat, b in summary["by_category"].items():
        rs = [r for r in records if r["category"] == cat]
        ar = _median([r["ar_tok_s"] for r in rs])
        sp = _median([r["spec_tok_s"] for r in rs])
        pt = f"{_median([r['peer_tok_s'] for r in rs]):.1f}" if peer else ""
        lines.append(
            f"| {cat} | {b['prompts']} | {ar:.1f} | {sp:.1f} | "
            f"{b['median_speedup']:.2f}x | {b['min_speedup']:.2f}x | {b['mean_tau']:.2f} "
            f"| {b['floored_fraction']:.0%} | {b['identical']}/{b['prompts']} |" + peer_cols(b, pt)
        )
    for name in ("grounded", "open", "all"):
        b = summary[name]
        if b["prompts"]:
            lines.append(
                f"| **{name}** | {b['prompts']} | | | **{b['median_speedup']:.2f}x** | "
                f"{b['min_speedup']:.2f}x | {b['mean_tau']:.2f} | "
                f"{b['floored_fraction']:.0%} | {b['identical']}/{b['prompts']} |"
                + peer_cols(b, "")
            )
    return "\n".join(lines)


def run_suite(
    model: Any,
    tokenizer: Any,
    suite: list[Prompt],
    *,
    drafter: str,
    repeats: int = 3,
    max_tokens: int | None = None,
    spec_kwargs: dict | None = None,
    progress: bool = True,
    use_template: bool = True,
    peer: PeerConfig | None = None,
) -> dict:
    """Warm up, then per prompt interleave mlx-lm AR, adaspec and (with `peer`) mlx-lm's
    speculative decoding; returns records + summary."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler
    from tqdm import tqdm

    from .api import stream_generate

    spec_kwargs = dict(spec_kwargs or {})

    def run_ar(ids: list[int], n: int) -> Run:
        if spec_kwargs.get("seed") is not None:
            mx.random.seed(spec_kwargs["seed"])
        smp = sampler(spec_kwargs, make_sampler)
        return timed(mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=n, sampler=smp))

    def run_spec(ids: list[int], n: int) -> Run:
        return timed(
            stream_generate(model, tokenizer, ids, drafter=drafter, max_tokens=n, **spec_kwargs)
        )

    prompts = [(p, prompt_ids(tokenizer, p.messages, use_template)) for p in suite]
    if max_tokens is not None:
        prompts = [
            (Prompt(p.id, p.category, p.grounded, p.messages, max_tokens), ids)
            for p, ids in prompts
        ]
    warm = prompts[0][1]
    run_ar(warm, 16), run_spec(warm, 16)
    runners: dict[str, Runner] = {"ar": run_ar, "spec": run_spec}
    config = {"drafter": drafter, "repeats": repeats, **spec_kwargs}
    peer_k = 0
    if peer is not None:
        runners["peer"], peer_k, config["peer"] = setup_peer(
            peer, model, tokenizer, spec_kwargs, [ids for _, ids in prompts]
        )
    records = []
    for p, ids in tqdm(prompts, desc="bench", unit="prompt", disable=not progress):
        records.append(bench_prompt(p, runners, ids, repeats, peer_k))
    return {"records": records, "summary": summarize(records), "config": config}


def save(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2, default=lambda o: asdict(o)))
