"""Timing one generation from its response stream, the same way for mlx-lm and adaspec, and
mlx-lm's sampler for the bench's sampling flags (the AR and peer columns share it)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Run:
    """One timed generation: tokens, end-to-end and post-first-step decode rates."""

    tokens: list[int]
    e2e_s: float
    decode_tok_s: float
    stats: dict = field(default_factory=dict)
    # sharded target: what crossed the network per step after the first (rank 0's view)
    wire: dict = field(default_factory=dict)


def wire_meter() -> Callable[[], tuple[int, int]] | None:
    """On a sharded target: a reading of (bytes rank 0 sent and received so far, as TCP
    counts them, collectives it issued so far); None for one process."""
    from ..distributed.world import world

    w = world()
    if w.size == 1:
        return None
    return lambda: (sum(w.wire_bytes()), w.collectives)


def _steps(r: Any, tokens: int) -> int:
    """Target steps so far: adaspec's count, or one forward a token for mlx-lm."""
    stats = getattr(r, "stats", None)
    return int(stats.summary().get("steps", 0)) if stats is not None else tokens


def _wire(m0: tuple[int, int], m1: tuple[int, int], steps: int, tokens: int) -> dict:
    steps, tokens = max(1, steps), max(1, tokens)
    return {
        "steps": steps,
        "bytes_per_step": round((m1[0] - m0[0]) / steps, 1),
        "collectives_per_step": round((m1[1] - m0[1]) / steps, 2),
        "bytes_per_token": round((m1[0] - m0[0]) / tokens, 1),
    }


def timed(stream: Iterable[Any]) -> Run:
    """Consume a response stream. Decode rate counts the tokens after the first step, over the
    time after the first step, so AR (1 token per step) and speculation are measured alike;
    so do the bytes and collectives per step on a sharded target (prefill left out)."""
    meter = wire_meter()
    t0 = time.perf_counter()
    tokens: list[int] = []
    t_first, first_step_tokens, last = None, 0, None
    m0, steps0 = (0, 0), 0
    for r in stream:
        tokens.append(r.token)
        last = r
        if t_first is None and (getattr(r, "step", None) is not None or not hasattr(r, "step")):
            t_first, first_step_tokens = time.perf_counter(), len(tokens)
            if meter is not None:
                m0, steps0 = meter(), _steps(r, len(tokens))
    t_end = time.perf_counter()
    wire = {}
    if meter is not None and last is not None:
        n = len(tokens) - first_step_tokens
        wire = _wire(m0, meter(), _steps(last, len(tokens)) - steps0, n)
    if last is not None and last.finish_reason == "stop":
        tokens = tokens[:-1] if last.text == "" else tokens  # EOS is not output
    n_after = len(tokens) - first_step_tokens
    dt = t_end - (t_first or t_end)
    summary = getattr(last, "stats", None)
    stats = summary.summary() if summary is not None else {}
    return Run(tokens, t_end - t0, n_after / dt if dt > 0 and n_after > 0 else 0.0, stats, wire)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def sampler(kw: dict, make_sampler: Callable[..., Any]) -> Any:
    """mlx-lm's sampler for the bench's sampling flags (greedy at temp 0)."""
    return make_sampler(
        temp=kw.get("temp", 0.0),
        top_p=kw.get("top_p", 0.0),
        min_p=kw.get("min_p", 0.0),
        top_k=kw.get("top_k", 0),
    )
