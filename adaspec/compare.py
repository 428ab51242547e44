"""`compare_to_ar`: one prompt through adaspec and through mlx-lm's plain AR, side by side in
one process: decode rates, the speedup and whether the tokens are the same."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .api import Drafters


@dataclass(frozen=True)
class Comparison:
    """What `compare_to_ar` measured. Rates count the tokens after the first step over the
    time after it (the median over `repeats`); `identical` is expected at temperature 0 (at
    T>0 the two draw differently from the same distribution); `stats` is adaspec's summary."""

    identical: bool
    ar_tok_s: float
    spec_tok_s: float
    tokens: list[int]
    ar_tokens: list[int]
    stats: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.spec_tok_s / self.ar_tok_s if self.ar_tok_s else 0.0

    def __str__(self) -> str:
        s = self.stats
        return (
            f"AR {self.ar_tok_s:.1f} tok/s, adaspec {self.spec_tok_s:.1f} tok/s, speedup "
            f"{self.speedup:.2f}x, tau {s.get('tau', 0):.2f}, accepted {s.get('accepted', 0)}/"
            f"{s.get('drafted', 0)}, identical: {self.identical}"
        )


def compare_to_ar(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int],
    *,
    drafter: Drafters = "auto",
    max_tokens: int = 256,
    repeats: int = 1,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    warmup: bool = True,
    **kwargs: Any,
) -> Comparison:
    """Generate `prompt` with mlx-lm's `stream_generate` (plain AR) and with adaspec's
    (speculating with `drafter`, default "auto"), alternating, `repeats` times each. `prompt`
    is fed as is, like `stream_generate` does (apply a chat template first if wanted);
    `kwargs` go to adaspec's stream_generate (stop, settings, policy, ...). warmup: first run
    both once, untimed, on another prompt (adaspec/warmup.py), so neither side's timing holds
    a kernel build or a drafter's first use."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from .api import stream_generate
    from .bench.timing import Run, median, timed
    from .warmup import warm_generations, warm_ids

    prompt = prompt if isinstance(prompt, str) else [int(t) for t in prompt]

    def run_ar(p: str | list[int], n: int) -> Run:
        if seed is not None:
            mx.random.seed(seed)
        sampler = make_sampler(temp, top_p, min_p, top_k=top_k)
        return timed(mlx_lm.stream_generate(model, tokenizer, p, max_tokens=n, sampler=sampler))

    def run_spec(p: str | list[int], n: int) -> Run:
        ours = stream_generate(
            model, tokenizer, p, drafter=drafter, max_tokens=n, seed=seed, temp=temp,
            top_p=top_p, top_k=top_k, min_p=min_p, **kwargs,
        )  # fmt: skip
        return timed(ours)

    if warmup:
        warm_generations([run_ar, run_spec], warm_ids(tokenizer, use_template=False))
    ar_runs, spec_runs = [], []
    for _ in range(max(1, repeats)):
        ar_runs.append(run_ar(prompt, max_tokens))
        spec_runs.append(run_spec(prompt, max_tokens))
    ar, spec = ar_runs[-1], spec_runs[-1]
    return Comparison(
        identical=ar.tokens == spec.tokens,
        ar_tok_s=median([r.decode_tok_s for r in ar_runs]),
        spec_tok_s=median([r.decode_tok_s for r in spec_runs]),
        tokens=spec.tokens,
        ar_tokens=ar.tokens,
        stats=spec.stats,
    )
