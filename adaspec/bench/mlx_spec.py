"""mlx-lm's own speculative decoding as a third bench column (`adaspec bench --peer mlx-lm-spec`):
same target, same draft model, same prompt ids, interleaved with AR and adaspec."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ..errors import GenerationArgumentError
from .timing import sampler, timed

log = logging.getLogger(__name__)

SPEC_PEER = "mlx-lm-spec"
# the peers `adaspec bench --peer` takes: this module's, and stock mlx-lm (bench/stock.py)
PEERS = (SPEC_PEER, "mlx-lm-stock")
K_CHOICES = (2, 3, 4, 5, 6)


@dataclass(frozen=True)
class PeerConfig:
    """draft_model: the mlx-lm model mlx-lm drafts with; k: its num_draft_tokens, 0 = pick the
    best of K_CHOICES on the first `tune_prompts` prompts at `tune_tokens` tokens each."""

    draft_model: Any
    k: int = 0
    tune_prompts: int = 2
    tune_tokens: int = 48


def spec_counts(from_draft: Sequence[bool], k: int, max_tokens: int) -> dict:
    """Verify steps, drafted and accepted tokens of one mlx-lm speculative generation, rebuilt
    from its per-token from_draft flags: each step drafts min(k, tokens left) and emits its
    accepted drafts followed by one target token (unless max_tokens cut the step short)."""
    steps = drafted = accepted = first = 0
    i, n = 0, len(from_draft)
    while i < n:
        nd = min(k, max_tokens - i)
        a = 0
        while i < n and from_draft[i] and a < nd:
            a, i = a + 1, i + 1
        if i < n and not from_draft[i]:
            i += 1
        steps, drafted, accepted, first = steps + 1, drafted + nd, accepted + a, first + (a > 0)
    return {
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "tau": round(n / steps, 4) if steps else 0.0,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "acceptance_first": round(first / steps, 4) if steps else 0.0,
    }


def _marked(stream: Iterable[Any], flags: list[bool]) -> Iterator[Any]:
    """mlx-lm responses with `step` set on the last token of each verify step (the target's own
    token), so the bench's decode rate starts after the first step, as it does for adaspec."""
    for r in stream:
        flags.append(bool(r.from_draft))
        yield SimpleNamespace(**vars(r), step=None if r.from_draft else True)


def make_runner(
    model: Any, tokenizer: Any, draft_model: Any, sampler_kwargs: dict
) -> Callable[[list[int], int, int], Any]:
    """run(ids, max_tokens, k) -> bench Run of mlx_lm.stream_generate(draft_model=..., k)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    seed = sampler_kwargs.get("seed")

    def run(ids: list[int], max_tokens: int, k: int) -> Any:
        if seed is not None:
            mx.random.seed(seed)
        flags: list[bool] = []
        stream = mlx_lm.stream_generate(
            model,
            tokenizer,
            ids,
            max_tokens=max_tokens,
            draft_model=draft_model,
            num_draft_tokens=k,
            sampler=sampler(sampler_kwargs, make_sampler),
        )
        r = timed(_marked(stream, flags))
        r.stats = spec_counts(flags[: len(r.tokens)], k, max_tokens)
        return r

    return run


def tune_k(
    run: Callable[[list[int], int, int], Any],
    prompts: Sequence[list[int]],
    max_tokens: int,
    ks: Sequence[int] = K_CHOICES,
) -> tuple[int, dict[int, float]]:
    """The num_draft_tokens with the best median decode rate over `prompts` (each k once per
    prompt, the ks interleaved per prompt), and the rate of every k."""
    rates: dict[int, list[float]] = {k: [] for k in ks}
    for ids in prompts:
        for k in ks:
            rates[k].append(run(ids, max_tokens, k).decode_tok_s)
    med = {k: round(statistics.median(v), 3) for k, v in rates.items()}
    best = max(med, key=lambda k: med[k])
    log.info("mlx-lm-spec num_draft_tokens tuning: %s -> %d", med, best)
    return best, med


def peer_names(peer: str | None) -> list[str]:
    """The peers a --peer value names (one, or several joined by commas), each checked."""
    names = [n.strip() for n in (peer or "").split(",") if n.strip()]
    for name in names:
        if name not in PEERS:
            raise GenerationArgumentError(
                f"--peer {name!r} is unknown; accepted: {', '.join(PEERS)} (or both, joined by "
                "a comma)"
            )
    return names


def check_peer(peer: str | None, draft: str | None) -> None:
    if SPEC_PEER in peer_names(peer) and not draft:
        raise GenerationArgumentError(
            "--peer mlx-lm-spec needs a draft model: --peer-draft PATH_OR_NAME, or "
            "--drafter draft-model:PATH_OR_NAME (the same model is used)"
        )


def peer_fields(peer: list[Any], ar: list[Any], spec: list[Any], k: int) -> dict:
    """The peer's numbers for one prompt's bench record (medians over repeats)."""
    med = statistics.median
    tps = med([r.decode_tok_s for r in peer])
    e2e = med([len(r.tokens) / r.e2e_s for r in peer])
    ar_tps = med([r.decode_tok_s for r in ar])
    sp_tps = med([r.decode_tok_s for r in spec])
    s = peer[-1].stats
    return {
        "peer_k": k,
        "peer_tok_s": round(tps, 2),
        "peer_e2e_tok_s": round(e2e, 2),
        "peer_speedup": round(tps / ar_tps, 4) if ar_tps else 0.0,
        "spec_vs_peer": round(sp_tps / tps, 4) if tps else 0.0,
        "peer_identical": peer[0].tokens == ar[0].tokens,
        "peer_tau": s["tau"],
        "peer_acceptance_rate": s["acceptance_rate"],
        "peer_acceptance_first": s["acceptance_first"],
    }


def peer_block(rs: list[dict]) -> dict:
    """Summary of the peer columns over records `rs` (empty if there is no peer)."""
    if not rs or "peer_tok_s" not in rs[0]:
        return {}
    med = statistics.median
    return {
        "median_peer_speedup": round(med([r["peer_speedup"] for r in rs]), 4),
        "median_spec_vs_peer": round(med([r["spec_vs_peer"] for r in rs]), 4),
        "peer_mean_tau": round(statistics.fmean([r["peer_tau"] for r in rs]), 4),
        "peer_acceptance_rate": round(med([r["peer_acceptance_rate"] for r in rs]), 4),
        "peer_identical": sum(r["peer_identical"] for r in rs),
    }


def setup_peer(
    cfg: PeerConfig, model: Any, tokenizer: Any, sampler_kwargs: dict, prompts: list[list[int]]
) -> tuple[Callable[[list[int], int], Any], int, dict]:
    """The peer's bench runner at its chosen k, the k, and how it was chosen (for the JSON)."""
    run = make_runner(model, tokenizer, cfg.draft_model, sampler_kwargs)
    run(prompts[0], 16, K_CHOICES[0])  # warm-up
    if cfg.k:
        k, info = cfg.k, {"name": SPEC_PEER, "k": cfg.k, "tuned": False}
    else:
        k, rates = tune_k(run, prompts[: cfg.tune_prompts], cfg.tune_tokens)
        info = {
            "name": SPEC_PEER,
            "k": k,
            "tuned": True,
            "tune_prompts": cfg.tune_prompts,
            "tune_tokens": cfg.tune_tokens,
            "tune_decode_tok_s": rates,
        }
    return (lambda ids, n: run(ids, n, k)), k, info
