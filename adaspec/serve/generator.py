"""Generation for `adaspec serve`: mlx-lm's ResponseGenerator (its tokenizing, chat templates,
stop sequences, response framing) with the batching loop replaced by one request at a time
through adaspec's decoder, each conversation resuming from a pooled PromptCache."""

from __future__ import annotations

import copy
import logging
import time
from contextlib import closing
from typing import Any

from mlx_lm.server import (
    GenerationContext,
    Response,
    ResponseGenerator,
    _format_top_logprobs,
    _make_logits_processors,
)

from ..api import PromptCache, make_prompt_cache, stream_generate
from ..errors import AdaspecError, GenerationArgumentError

log = logging.getLogger("adaspec.serve")

MAX_TOKENS_UNKNOWN_CONTEXT = 1 << 20  # max_tokens cap when the model declares no context length


def context_length(model: Any) -> int | None:
    """The model's declared context (max_position_embeddings), if any."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    src = text if isinstance(text, dict) else vars(args) if args is not None else {}
    n = src.get("max_position_embeddings") or getattr(args, "max_position_embeddings", None)
    return int(n) if n else None


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class CachePool:
    """Up to `size` PromptCaches, least recently used first. A request takes the cache of its
    drafter sharing the longest prefix with it when that prefix keeps at least half of what the
    cache holds (a later turn of its conversation: a reply is not always re-tokenized to the
    tokens generated); otherwise a new cache while there is room, else that longest-prefix
    cache anyway (rolled back), else the place of the least recently used.
    A new cache starts from a copy of the policy of the cache last given back with its drafter
    (what the server has measured of the arms and of a plain step), not from priors."""

    def __init__(self, size: int):
        self.size = max(int(size), 1)
        self.entries: list[tuple[str, PromptCache]] = []
        self.policies: dict[str, Any] = {}

    def take(self, spec: str, prompt: list[int], make: Any) -> PromptCache:
        scored = [
            (_common(c.tokens, prompt), i) for i, (s, c) in enumerate(self.entries) if s == spec
        ]
        full = len(self.entries) >= self.size
        if scored:
            n, i = max(scored)
            if 2 * n >= len(self.entries[i][1].tokens) or full:
                return self.entries.pop(i)[1]
        if full:
            self.entries.pop(0)
        cache = make()
        if spec in self.policies:
            cache.policy = copy.deepcopy(self.policies[spec])
        return cache

    def give(self, spec: str, cache: PromptCache) -> None:
        self.entries.append((spec, cache))
        self.policies[spec] = cache.policy

    def clear(self) -> None:
        self.entries.clear()
        self.policies.clear()


class SpecResponseGenerator(ResponseGenerator):
    """Serves requests one at a time, in arrival order, on the generation thread mlx-lm's
    handler talks to; a bad request is marked (`request.bad`) so the handler answers 400."""

    def __init__(self, model_provider: Any, pool: CachePool, drafter: str):
        self.pool, self.drafter, self._pool_key = pool, drafter, None
        super().__init__(model_provider, None)  # starts the generation thread

    def _generate(self) -> None:
        self.model_provider.load_default()
        while not self._stop:
            item = self._next_request(timeout=0.1)
            if item is None:
                continue
            rqueue, request, args = item
            try:
                self.model_provider.load(args.model.model, args.model.adapter, args.model.draft)
            except Exception as e:
                rqueue.put(e)
                continue
            if self.model_provider.model_key != self._pool_key:
                self.pool.clear()
                self._pool_key = self.model_provider.model_key
            self._serve_single(item, None)
        self.pool.clear()
        self.model_provider.reset()

    def _serve_single(self, item: tuple, stream: Any) -> None:
        rqueue, request, args = item
        try:
            self._serve(rqueue, request, args)
        except Exception as e:
            request.bad = isinstance(e, AdaspecError)
            rqueue.put(e)

    def _prepare(self, request: Any, args: Any) -> tuple[list[int], str, GenerationContext]:
        tokenizer = self.model_provider.tokenizer
        prompt, _, _, initial_state, vision = self._tokenize(tokenizer, request, args)
        field = "messages" if request.request_type == "chat" else "prompt"
        if vision is not None:
            raise GenerationArgumentError(f"{field} holds images; accepted: text only")
        limit = context_length(self.model_provider.model)
        if limit is not None and len(prompt) >= limit:
            raise GenerationArgumentError(
                f"{field} is {len(prompt)} tokens, more than the model's context of {limit}; "
                f"accepted: fewer than {limit} tokens"
            )
        _, text_sm = self._make_state_machine(
            self.model_provider.model_key, tokenizer, args.stop_words
        )
        ctx = GenerationContext(
            has_thinking=tokenizer.has_thinking,
            has_tool_calling=tokenizer.has_tool_calling,
            tool_parser=tokenizer.tool_parser,
            text_sm=text_sm,
            initial_state=initial_state,
            prompt=prompt,
        )
        return prompt, getattr(request, "drafter", None) or self.drafter, ctx

    def _serve(self, rqueue: Any, request: Any, args: Any) -> None:
        model, tokenizer = self.model_provider.model, self.model_provider.tokenizer
        prompt, spec, ctx = self._prepare(request, args)
        stop_sequences, _ = self._make_state_machine(
            self.model_provider.model_key, tokenizer, args.stop_words
        )
        cache = self.pool.take(
            spec, prompt, lambda: make_prompt_cache(model, tokenizer, drafter=spec)
        )
        rqueue.put(ctx)
        s = args.sampling
        gen, n, tic = None, 0, time.perf_counter()
        stop_matcher = stop_sequences.matcher()
        try:
            responses = stream_generate(
                model, tokenizer, prompt, prompt_cache=cache, max_tokens=args.max_tokens,
                temp=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                logits_processors=_make_logits_processors(args), seed=args.seed,
            )  # fmt: skip
            with closing(responses):
                for gen in responses:
                    n += 1
                    finish = "stop" if stop_matcher.advance(gen.token) else gen.finish_reason
                    lp = gen.logprobs
                    top = _format_top_logprobs(lp, args.top_logprobs, tokenizer)
                    rqueue.put(Response(gen.text, gen.token, lp[gen.token].item(), finish, top))
                    if n == 1:
                        ctx.prompt_cache_count = gen.stats.cached_tokens
                        first = time.perf_counter() - tic
                    if ctx._should_stop or finish is not None:
                        break
        finally:
            self.pool.give(spec, cache)
        request.usage = usage(gen, spec, n, first, time.perf_counter() - tic - first)
        log.info("request: %s", " ".join(f"{k}={v}" for k, v in request.usage.items()))
        rqueue.put(None)


def usage(gen: Any, spec: str, n: int, first_s: float, decode_s: float) -> dict:
    """The speculation figures a response's usage carries under "adaspec"."""
    st = gen.stats
    return {
        "drafter": spec,
        "tau": round(st.tau, 3),
        "acceptance": round(st.acceptance_rate, 3),
        "floored_fraction": round(st.floored_fraction, 3),
        "prompt_tokens": st.prompt_tokens,
        "cached_tokens": st.cached_tokens,
        "generated_tokens": n,
        "prefill_s": round(st.prefill_s, 4),
        "first_token_s": round(first_s, 4),
        "decode_tps": round((n - 1) / decode_s, 2) if n > 1 and decode_s > 0 else 0.0,
    }
