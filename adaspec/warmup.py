"""Warm-up: every kernel a generation uses built, or loaded from the cache, before anything is
timed.

A model's first forward in a process builds the compiled CPU kernels mlx needs for it
(`mx.compile`: one `g++` run each on an empty cache, a load from ADASPEC_CACHE/jit after that),
a verify forward of several rows needs a few more than a one-row step, and mlx's buffer pool
grows over the first steps: on an empty cache, seconds inside the first generation's decode.
`warm_up` runs each path a generation takes once, on a handful of tokens: adaspec's plain
steps, its verify forwards of 2, 4, 8 and 16 rows (then draft trees where ADASPEC_TREE_NODES
allows them), the rollbacks after them, and mlx-lm's own decoding loop. `adaspec.load` calls
it; with the kernels on disk it costs a few forwards (~0.2 s on SmolLM2-135M). A drafter's
own model and a sampler at T > 0 are first used by a generation: `compare_to_ar`, `adaspec
generate --compare-ar` / `--compare-stock` and `adaspec bench` run each side once on MESSAGE
(`warm_generations`) before they time anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .drafters.base import Draft, DraftContext
from .sampling_params import SamplingParams
from .settings import Settings
from .settings import get as get_settings

log = logging.getLogger(__name__)

WIDTHS = (1, 3, 7, 15)  # tokens drafted per warm-up verify: forwards of 2, 4, 8 and 16 rows
PROMPT_TOKENS = 24
PLAIN_TOKENS = 4
# the prompt `warm_generations` generates from (chat-templated by the caller): another prompt
# than the timed one, so a drafter that learns from what was generated (`suffix`) learns
# nothing about the answer it is timed on
MESSAGE = "Write the numbers from one to twelve in words, one per line."


class _Chain:
    """A drafter proposing WIDTHS[i % len(WIDTHS)] tokens at its i-th call (prompt tokens, so
    valid ids): chains in the first round of widths, then trees of two branches where the step
    allows trees."""

    name = "warm-up"
    needs_taps: tuple[int, ...] = ()
    vocab_size: int | None = None

    def __init__(self) -> None:
        self.calls = 0

    def prefill(self, prompt_tokens: Sequence[int], ctx: DraftContext) -> None:
        pass

    def draft(self, ctx: DraftContext) -> Draft:
        k = min(WIDTHS[self.calls % len(WIDTHS)], ctx.max_draft)
        self.calls += 1
        seen = list(ctx.tokens)
        tokens = [seen[j % len(seen)] for j in range(k)]
        tree = self.calls > len(WIDTHS) and ctx.tree_nodes >= 3
        if tree and k >= 3 and len(set(seen)) >= 2:
            other = next(t for t in seen if t != tokens[0])
            nodes = [tokens[0], other, *tokens[1 : min(k, ctx.tree_nodes) - 1]]
            # two roots; the first one's chain goes on below it
            parents = [-1, -1] + [0 if i == 2 else i - 1 for i in range(2, len(nodes))]
            return Draft(tuple(nodes), parents=tuple(parents))
        return Draft(tuple(tokens))

    def advance(self, committed_tokens: Sequence[int], ctx: DraftContext) -> None:
        pass

    def rollback(self, n: int) -> None:
        pass


def warm_prompt(vocab_size: int, n: int = PROMPT_TOKENS) -> list[int]:
    """`n` token ids spread over the vocabulary (ids 1.., every one valid)."""
    top = max(2, min(vocab_size, 1 << 16))
    return [1 + (i * 7919) % (top - 1) for i in range(n)]


def warm_up(
    model: Any,
    tokenizer: Any = None,
    *,
    sampling: SamplingParams | None = None,
    settings: Settings | None = None,
) -> float:
    """Run adaspec's plain and verify steps and mlx-lm's decoding loop on `model` once, on a
    few tokens and a throwaway cache, so that the kernels they use are built (or loaded) now;
    `sampling` also warms that sampler (default greedy). Returns the seconds it took."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from .loop.controller import DecodeConfig, Decoder, decode
    from .loop.plan import AlwaysSpeculate, NeverSpeculate
    from .targets import target_for

    t0 = time.perf_counter()
    settings = settings or get_settings()
    params = sampling or SamplingParams()

    def target() -> Any:
        return target_for(model, tokenizer, settings)

    first = target()
    ids = warm_prompt(first.info.vocab_size)
    cfg = DecodeConfig(
        max_tokens=64,
        sampling=params.check(first.info.vocab_size),
        tree_nodes=max(settings.tree_cap, 0),
        overlap_draft=settings.overlap_draft,
    )
    rng = np.random.default_rng(0)
    plain = Decoder(first, [], cfg, NeverSpeculate(), rng)
    for n, _ in enumerate(decode(plain, ids), 1):
        if n == PLAIN_TOKENS:
            break
    spec = Decoder(target(), [_Chain()], cfg, AlwaysSpeculate(), rng)
    rounds = 2 if cfg.tree_nodes >= 3 and not spec.chains_only else 1  # chains, then trees
    steps = 0
    for ev in decode(spec, ids):
        steps += ev.step is not None
        if steps == rounds * len(WIDTHS) + 1:  # every width, then a step after the last rollback
            break
    sampler = make_sampler(params.temp, params.top_p, params.min_p, top_k=params.top_k)
    for n, _ in enumerate(generate_step(mx.array(ids), model, max_tokens=4, sampler=sampler), 1):
        if n == PLAIN_TOKENS:
            break
    mx.clear_cache()
    seconds = time.perf_counter() - t0
    log.info("warm-up of %s: %.2f s", type(model).__name__, seconds)
    return seconds


def warm_generations(
    runners: Sequence[Callable[[list[int], int], Any]], ids: list[int], max_tokens: int = 16
) -> None:
    """Run each of `runners` (a function of prompt ids and a token count that generates, as the
    timed runs do) once on `ids` for `max_tokens` tokens."""
    for run in runners:
        run(ids, max_tokens)


def warm_ids(tokenizer: Any, use_template: bool = True) -> list[int]:
    """The ids `warm_generations` generates from: MESSAGE, chat-templated where wanted."""
    from .prompting import messages_for, prompt_ids

    return prompt_ids(tokenizer, messages_for(MESSAGE, None), use_template)
