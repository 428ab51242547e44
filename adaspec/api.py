"""Public API: `stream_generate` / `generate`, shaped like mlx-lm's, with speculative stats."""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np

from . import settings as settings_mod
from .distributed import target_for
from .drafters.arms import DrafterPlan
from .drafters.base import DraftModel
from .errors import DrafterMismatchError, GenerationArgumentError
from .loop.controller import DecodeConfig, Decoder, TokenEvent, decode
from .loop.plan import NeverSpeculate, SpecPolicy
from .loop.stats import GenerationStats, StepStats
from .policy.latest import continued
from .sampling_params import SamplingParams


@dataclass
class Response:
    """mlx-lm's GenerationResponse fields, plus `step` (set on the last token of each
    controller step) and `stats` (cumulative for this generation, updated in place)."""

    text: str
    token: int
    logprobs: mx.array
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    step: StepStats | None = None
    stats: GenerationStats | None = None


def load(
    path_or_name: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    settings: settings_mod.Settings | None = None,
    warmup: bool = True,
) -> tuple[Any, Any]:
    """(model, TokenizerWrapper) for an mlx-lm folder / HF id, a .gguf file or a catalogue name
    (targets/loader.py), on the CPU fast paths. warmup: run each decoding path once on a few
    tokens (adaspec/warmup.py), so the kernels the model's generations use are built now, not
    inside the first one; skipped in a process started by mlx.launch or mpirun, whose model is
    sharded after loading (its weights are read lazily, each rank only its share)."""
    from .distributed.world import backend_name
    from .targets.loader import load as load_model
    from .warmup import warm_up

    settings = settings or settings_mod.get()
    model, tokenizer = load_model(path_or_name, dtype=dtype, settings=settings)
    if warmup and backend_name() == "none":
        warm_up(model, tokenizer, settings=settings)
    return model, tokenizer


def _wrap_tokenizer(tokenizer: Any) -> Any:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int] | mx.array) -> list[int]:
    """Tokenize like mlx-lm (special tokens added unless the text already starts with BOS)."""
    if isinstance(prompt, str):
        if not prompt:
            raise GenerationArgumentError("prompt is empty; accepted: a non-empty string or ids")
        bos = tokenizer.bos_token
        add = bos is None or not prompt.startswith(bos)
        ids = list(tokenizer.encode(prompt, add_special_tokens=add))
    elif isinstance(prompt, mx.array):
        ids = [int(t) for t in cast("list[int]", prompt.reshape(-1).tolist())]
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise GenerationArgumentError("prompt has no tokens; accepted: at least one token")
    return ids


Drafters = str | DrafterPlan | DraftModel | Sequence[str | DrafterPlan | DraftModel] | None


def resolve_drafters(
    drafter: Drafters, info: Any, settings: settings_mod.Settings
) -> list[DraftModel]:
    """The arms `drafter` names: a spec ("pld", "pld+dflash:DIR", "auto", "none", made a
    DrafterPlan here), a DrafterPlan, a DraftModel, or a list of those; checked against the
    target's vocabulary."""
    from .drafters.arms import plan

    if drafter is None:
        return []
    items: Sequence[str | DrafterPlan | DraftModel]
    if isinstance(drafter, (str, DrafterPlan)) or not isinstance(drafter, Sequence):
        items = [drafter]
    else:
        items = drafter
    arms: list[DraftModel] = []
    for item in items:
        if isinstance(item, (str, DrafterPlan)):
            arms += plan(item, info, settings).build(info, settings)
        else:
            arms.append(item)
    for d in arms:
        if d.vocab_size is not None and d.vocab_size != info.vocab_size:
            raise DrafterMismatchError(
                f"drafter {d.name!r} has vocabulary size {d.vocab_size}, the target has "
                f"{info.vocab_size}; accepted: a drafter over the target's vocabulary"
            )
    return arms


def default_policy(arms: Sequence[DraftModel], settings: settings_mod.Settings) -> SpecPolicy:
    """Gated (per ADASPEC_GATE; "off" never floors) with adaptive draft length when there is a
    drafter; plain AR otherwise."""
    if not arms:
        return NeverSpeculate()
    from .policy.adaptive import GatedPolicy, PolicyConfig

    return GatedPolicy(PolicyConfig.from_settings(settings))


def _find_stop(text: str, stop: Sequence[str], since: int) -> int | None:
    """Start of the earliest stop string that ends after position `since`, or None."""
    hits = [i for s in stop if (i := text.find(s, max(since - len(s) + 1, 0))) >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into a stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-k:]):
                best = k
                break
    return best


class PromptCache:
    """What a generation leaves for the next one on the same model: the target's mlx-lm cache,
    the drafter arms and the tokens they hold. Pass it as `prompt_cache=` with the whole next
    prompt: only the tokens past the common prefix are prefilled (recurrent state only when
    the held tokens are a prefix of the new prompt). Serves one generation at a time."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        drafter: Drafters = None,
        settings: settings_mod.Settings | None = None,
    ):
        self.model = model
        self.tokenizer = None if tokenizer is None else _wrap_tokenizer(tokenizer)
        self.settings = settings or settings_mod.get()
        self.reset()
        self.arms = resolve_drafters(drafter, self.target.info, self.settings)
        # the default policy of this cache's generations: what it measured of the arms carries
        # from one turn to the next (GatedPolicy.start)
        self.policy = default_policy(self.arms, self.settings)

    def reset(self) -> None:
        """Forget the held tokens: a fresh target cache; the arms restart at the next prefill."""
        self.target = target_for(self.model, self.tokenizer, self.settings)
        self.tokens: list[int] = []


def make_prompt_cache(
    model: Any,
    tokenizer: Any = None,
    *,
    drafter: Drafters = None,
    settings: settings_mod.Settings | None = None,
) -> PromptCache:
    """A PromptCache for `model` speculating with `drafter` (as in `stream_generate`)."""
    return PromptCache(model, tokenizer, drafter=drafter, settings=settings)


def stream_generate(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int] | mx.array,
    *,
    drafter: Drafters = None,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    logits_processors: Sequence | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    policy: SpecPolicy | None = None,
    settings: settings_mod.Settings | None = None,
    prompt_cache: PromptCache | None = None,
) -> Iterator[Response]:
    """Generate like `mlx_lm.stream_generate`, speculating with `drafter`: a DraftModel, a
    registry spec such as "pld", "dflash:DIR" or "pld+dflash" (several arms, the policy picks
    one per step), a list of those, or None for plain AR. Output is the target's.
    With `prompt_cache` (from `make_prompt_cache`, which names the drafter), `prompt` is the
    whole prompt and the part the cache already holds is not prefilled again."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise GenerationArgumentError(f"max_tokens={max_tokens!r} is invalid; accepted: >= 1")
    if isinstance(stop, str) or any(not isinstance(s, str) or not s for s in stop):
        raise GenerationArgumentError(f"stop={stop!r} is invalid; accepted: non-empty strings")
    tokenizer = _wrap_tokenizer(tokenizer)
    decoder, ids = start_decoder(
        model, tokenizer, prompt, drafter=drafter, max_tokens=max_tokens, temp=temp,
        top_p=top_p, top_k=top_k, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep,
        logits_processors=logits_processors, seed=seed, policy=policy, settings=settings,
        prompt_cache=prompt_cache,
    )  # fmt: skip
    framed = texts(decoder, ids, tokenizer, max_tokens, tuple(stop))
    yield from kept(prompt_cache, decoder, framed) if prompt_cache else framed


def start_decoder(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int] | mx.array,
    *,
    drafter: Drafters = None,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    logits_processors: Sequence | None = None,
    seed: int | None = None,
    policy: SpecPolicy | None = None,
    settings: settings_mod.Settings | None = None,
    prompt_cache: PromptCache | None = None,
    shared_forward: bool = False,
) -> tuple[Decoder, list[int]]:
    """The Decoder stream_generate runs (arguments as there; `tokenizer` mlx-lm wrapped) and
    the prompt's ids. shared_forward: verify forwards may run beside other sequences'
    (serve/batch.py, which switches Decoder.share): drafts are chains only."""
    settings = settings or settings_mod.get()
    tokenizer = _wrap_tokenizer(tokenizer)
    ids = encode_prompt(tokenizer, prompt)
    pc = prompt_cache
    _check_cache(pc, model, drafter)
    target = pc.target if pc else target_for(model, tokenizer, settings)
    params = SamplingParams(temp, top_p, top_k, min_p, min_tokens_to_keep).check(
        target.info.vocab_size
    )
    arms = pc.arms if pc else resolve_drafters(drafter, target.info, settings)
    cfg = DecodeConfig(
        max_tokens=max_tokens,
        sampling=params,
        eos_ids=frozenset(tokenizer.eos_token_ids),
        logits_processors=tuple(logits_processors or ()),
        tree_nodes=0 if shared_forward else settings.tree_cap,
        overlap_draft=settings.overlap_draft,
    )
    pol = policy or (pc.policy if pc else None)
    if pol is None:  # from what the latest generation like this one measured
        pol = continued(model, drafter, settings, default_policy(arms, settings))
    held = pc.tokens if pc else ()
    decoder = Decoder(target, arms, cfg, pol, np.random.default_rng(seed), held=held)
    return decoder, ids


def _check_cache(pc: PromptCache | None, model: Any, drafter: Drafters) -> None:
    if pc is None:
        return
    if not isinstance(pc, PromptCache):
        raise GenerationArgumentError(
            f"prompt_cache={type(pc).__name__} is invalid; accepted: adaspec.make_prompt_cache()"
        )
    if pc.model is not model:
        raise GenerationArgumentError(
            "prompt_cache was made for another model; accepted: a cache made for this model"
        )
    if drafter is not None:
        raise GenerationArgumentError(
            f"drafter={drafter!r} given with a prompt_cache; accepted: the drafter named in "
            "make_prompt_cache(model, tokenizer, drafter=...)"
        )


def kept(pc: PromptCache, decoder: Decoder, framed: Iterator[Response]) -> Iterator[Response]:
    """Hand the committed tokens to the cache when the generation ends or is abandoned (the
    decode loop has rolled everything back to them); after an error, start it afresh."""
    ok = False
    try:
        yield from framed
        ok = True
    except GeneratorExit:
        ok = True
        raise
    finally:
        if ok:
            pc.tokens = decoder.committed
        else:
            pc.reset()


def texts(
    decoder: Decoder,
    ids: list[int],
    tokenizer: Any,
    max_tokens: int,
    stop: tuple[str, ...],
    events: Generator[TokenEvent, None, None] | None = None,
) -> Iterator[Response]:
    """Token events (default: `decode(decoder, ids)`) -> text responses; mlx-lm's framing (the
    last response carries the final token and finish_reason) plus stop strings, whose text is
    never emitted. Each event yields one response, the one that ends the generation included."""
    detok = tokenizer.detokenizer
    detok.reset()
    tic = time.perf_counter()
    stream = decode(decoder, ids) if events is None else events
    text, sent, prompt_tps, finish, cut = "", 0, 0.0, "length", None
    try:
        for n, ev in enumerate(stream):
            if n == 0:
                fed = len(ids) - decoder.stats.cached_tokens
                prompt_tps = fed / max(time.perf_counter() - tic, 1e-9)
                tic = time.perf_counter()
            if ev.token in decoder.cfg.eos_ids:
                finish = "stop"
                break
            detok.add_token(ev.token)
            text += detok.last_segment
            if stop and (cut := _find_stop(text, stop, sent)) is not None:
                finish = "stop"
                break
            if n + 1 == max_tokens:
                break
            safe = len(text) - (_held_back(text, stop) if stop else 0)
            yield _response(text[sent:safe], ev, n, len(ids), prompt_tps, tic, decoder)
            sent = safe
        if cut is None:
            detok.finalize()
            text += detok.last_segment
            if stop:
                cut = _find_stop(text, stop, sent)
                finish = "stop" if cut is not None else finish
        r = _response(text[sent:cut], ev, n, len(ids), prompt_tps, tic, decoder)
        r.finish_reason = finish
        yield r
    finally:
        stream.close()


def _response(
    text: str, ev: Any, n: int, n_prompt: int, prompt_tps: float, tic: float, dec: Decoder
) -> Response:
    return Response(
        text=text,
        token=ev.token,
        logprobs=ev.logprobs,
        from_draft=ev.from_draft,
        prompt_tokens=n_prompt,
        prompt_tps=prompt_tps,
        generation_tokens=n + 1,
        generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
        peak_memory=mx.get_peak_memory() / 1e9,
        step=ev.step,
        stats=dec.stats,
    )


def generate(model: Any, tokenizer: Any, prompt: str | Sequence[int], **kwargs: Any) -> str:
    """The full text `stream_generate` would stream."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))
