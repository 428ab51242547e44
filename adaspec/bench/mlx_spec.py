"""mlx-lm's own speculative decoding as a peer (`adaspec bench --peer mlx-lm-spec`): same
target, same draft model, same prompt ids, in this process, interleaved with AR and adaspec.
Its record fields are `peer_*` (`peer_tok_s`, `spec_vs_peer`, `peer_identical`: its tokens
against mlx-lm's AR, ...); its num_draft_tokens is given or picked on the first prompts."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ..errors import GenerationArgumentError
from .peers import Column, PeerKind, PeerOptions, PeerReport, PeerRequest, Runner, med_field
from .timing import Run, sampler, timed

log = logging.getLogger(__name__)

SPEC_PEER = "mlx-lm-spec"
K_CHOICES = (2, 3, 4, 5, 6)
WARM_TOKENS = 16


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


class SpecPeer:
    """mlx-lm's speculative decoding of `model` with `cfg.draft_model`; warm() picks its k
    when `cfg.k` is 0."""

    name = SPEC_PEER
    config_key = "peer"

    def __init__(self, cfg: PeerConfig, model: Any, tokenizer: Any, sampling: dict) -> None:
        self.cfg, self.k = cfg, cfg.k
        self._run = make_runner(model, tokenizer, cfg.draft_model, sampling)
        self.info: dict = {"name": SPEC_PEER, "k": cfg.k, "tuned": False}

    def runners(self) -> dict[str, Runner]:
        return {"peer": lambda ids, n: self._run(ids, n, self.k)}

    def warm(self, ids: list[int], prompts: Sequence[list[int]]) -> None:
        self._run(ids, WARM_TOKENS, K_CHOICES[0])
        if self.cfg.k:
            return
        self.k, rates = tune_k(self._run, prompts[: self.cfg.tune_prompts], self.cfg.tune_tokens)
        self.info = {
            "name": SPEC_PEER,
            "k": self.k,
            "tuned": True,
            "tune_prompts": self.cfg.tune_prompts,
            "tune_tokens": self.cfg.tune_tokens,
            "tune_decode_tok_s": rates,
        }

    def describe(self) -> dict:
        return dict(self.info)

    def fields(self, runs: dict[str, list[Run]], ar: list[Run], spec: list[Run]) -> dict:
        return peer_fields(runs["peer"], ar, spec, self.k)

    def close(self) -> None:
        pass


def check(options: PeerOptions) -> None:
    o = options
    if not 0 <= o.k <= 64 or o.tune_prompts < 1 or o.tune_tokens < 2:
        raise GenerationArgumentError(
            f"--peer-k={o.k}, --peer-tune-prompts={o.tune_prompts}, "
            f"--peer-tune-tokens={o.tune_tokens} are invalid; accepted: 0..64, >= 1, >= 2"
        )


def draft_of(options: PeerOptions, drafter: Any) -> str:
    """The draft model: --peer-draft, else the draft-model arm of the drafter plan in use."""
    arm = drafter.find("draft-model") if hasattr(drafter, "find") else None
    draft = options.draft or (arm.args.path if arm is not None else None)
    if not draft:
        raise GenerationArgumentError(
            "--peer mlx-lm-spec needs a draft model: --peer-draft PATH_OR_NAME, or "
            "--drafter draft-model:PATH_OR_NAME (the same model is used)"
        )
    return str(draft)


def start(req: PeerRequest) -> SpecPeer:
    """The peer for the CLI: its draft model loaded once, with fp32 weights as mlx-lm reads
    them (shared with a drafter that drafts from those)."""
    from ..drafters.draft_model import load_shared
    from ..settings import get

    o = req.options
    check(o)
    draft, _, _ = load_shared(draft_of(o, req.drafter), get())
    cfg = PeerConfig(draft, o.k, o.tune_prompts, o.tune_tokens)
    return SpecPeer(cfg, req.model, req.tokenizer, req.sampling)


def _tok_s(b: dict, rs: list[dict]) -> str:
    return f"{med_field(rs, 'peer_tok_s'):.1f}"


REPORT = PeerReport(
    key="peer_tok_s",
    block=peer_block,
    columns=(
        Column("mlx-lm spec tok/s", _tok_s),
        Column("peer vs AR", lambda b, rs: f"{b['median_peer_speedup']:.2f}x"),
        Column("spec vs peer", lambda b, rs: f"{b['median_spec_vs_peer']:.2f}x"),
        Column("peer tau", lambda b, rs: f"{b['peer_mean_tau']:.2f}"),
    ),
    rates=(("mlx-lm spec", "peer_tok_s"),),
)
KIND = PeerKind(
    SPEC_PEER,
    "mlx-lm's own speculative decoding in this process (--peer-draft, --peer-k)",
    REPORT,
    start,
    check,
)
