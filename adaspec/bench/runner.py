"""Side-by-side benchmark: mlx-lm's own AR and adaspec, and any peers (bench/peers.py: mlx-lm's
speculative decoding, stock mlx-lm, llama.cpp), interleaved per prompt."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..prompting import prompt_ids
from .peers import Peer, Runner
from .report import summarize
from .suite import Prompt
from .timing import Run, median, timed

if TYPE_CHECKING:
    from ..drafters.arms import DrafterPlan


def bench_prompt(
    prompt: Prompt,
    runners: dict[str, Runner],
    ids: list[int],
    repeats: int,
    peers: Sequence[Peer] = (),
) -> dict:
    """Time every runner ("ar", "spec" and the peers' own) on one prompt, interleaved
    A B C A B C so drift hits all alike; medians over the repeats, each peer's fields."""
    runs: dict[str, list[Run]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            runs[name].append(run(ids, prompt.max_tokens))
    ar, spec = runs["ar"], runs["spec"]
    ar_tps = median([r.decode_tok_s for r in ar])
    sp_tps = median([r.decode_tok_s for r in spec])
    ar_e2e = median([len(r.tokens) / r.e2e_s for r in ar])
    sp_e2e = median([len(r.tokens) / r.e2e_s for r in spec])
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
        # plain steps that timed plain decoding for the commit gate (not floors)
        "measure_fraction": round(s.get("measure_steps", 0) / s["steps"], 4)
        if s.get("steps")
        else 0.0,
        "identical": ref == got,
        # the AR output's fingerprint: runs under other settings (e.g. the fp32 expansion of
        # a GGUF model) can be checked for the same tokens
        "ar_tokens_sha1": hashlib.sha1(repr(list(ref)).encode()).hexdigest()[:16],
        "first_divergence": diverge if ref != got else None,
        **({"wire": {"ar": ar[-1].wire, "spec": spec[-1].wire}} if spec[-1].wire else {}),
        "repeats": repeats,
    }
    for peer in peers:
        record.update(peer.fields({k: runs[k] for k in peer.runners()}, ar, spec))
    return record


def run_suite(
    model: Any,
    tokenizer: Any,
    suite: list[Prompt],
    *,
    drafter: str | DrafterPlan,
    repeats: int = 3,
    max_tokens: int | None = None,
    spec_kwargs: dict | None = None,
    progress: bool = True,
    use_template: bool = True,
    peers: Sequence[Peer] = (),
) -> dict:
    """Warm up, then per prompt interleave mlx-lm AR, adaspec and each of `peers` (started;
    the caller closes them); returns records + summary + config. The warm-up generates from
    another prompt than the suite's (warmup.MESSAGE), so a drafter that learns from what was
    generated learns nothing of a timed answer."""
    from tqdm import tqdm

    from ..api import stream_generate
    from ..distributed.mirror import mirrored_ar
    from ..warmup import warm_generations, warm_ids

    spec_kwargs = dict(spec_kwargs or {})

    def run_ar(ids: list[int], n: int) -> Run:  # mlx-lm's (on every rank when sharded)
        return timed(mirrored_ar(model, tokenizer, ids, n, spec_kwargs))

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
    runners: dict[str, Runner] = {"ar": run_ar, "spec": run_spec}
    warm = warm_ids(tokenizer, use_template)
    warm_generations(list(runners.values()), warm)
    config: dict[str, Any] = {"drafter": str(drafter), "repeats": repeats, **spec_kwargs}
    for peer in peers:
        peer.warm(warm, [ids for _, ids in prompts])
        config[peer.config_key] = peer.describe()
        runners.update(peer.runners())
    records = []
    for p, ids in tqdm(prompts, desc="bench", unit="prompt", disable=not progress):
        records.append(bench_prompt(p, runners, ids, repeats, peers))
    return {"records": records, "summary": summarize(records), "config": config}
