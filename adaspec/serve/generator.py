"""Generation for `adaspec serve`: mlx-lm's ResponseGenerator (its tokenizing, chat templates,
stop sequences, response framing) with the batching loop replaced by one request at a time
through adaspec's decoder, each conversation resuming from a pooled PromptCache."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Generator
from contextlib import closing
from typing import Any, cast

from mlx_lm.server import (
    GenerationContext,
    Response,
    ResponseGenerator,
    _format_top_logprobs,
    _make_logits_processors,
)
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..api import PromptCache, make_prompt_cache, start_decoder, stream_generate
from ..api import Response as SpecResponse
from ..errors import AdaspecError, GenerationArgumentError
from .batch import Batch, Member, join

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
    (what the server has measured of the arms and of a plain step), not from priors.
    Given back, the pool drops its least recently used caches beyond `size` and, with
    `max_bytes`, while their KV caches hold more bytes than that (the newest is kept)."""

    def __init__(self, size: int, max_bytes: int | None = None):
        self.size = max(int(size), 1)
        self.max_bytes = max_bytes
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
        while len(self.entries) > self.size:
            self.entries.pop(0)
        while (
            self.max_bytes is not None and len(self.entries) > 1 and self.nbytes() > self.max_bytes
        ):
            self.entries.pop(0)

    def nbytes(self) -> int:
        """Bytes the pooled caches' target KV caches hold."""
        return sum(kv_bytes(c) for _, c in self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.policies.clear()


class _Request:
    """One request being answered: its queue to the handler, its context and stop sequences,
    its pooled cache; turns adaspec responses into mlx-lm's and accounts for them."""

    def __init__(self, gen: SpecResponseGenerator, item: tuple):
        self.rqueue, self.request, self.args = item
        self.server = gen
        self.prompt, self.spec, self.ctx = gen._prepare(self.request, self.args)
        provider = gen.model_provider
        stops, _ = gen._make_state_machine(
            provider.model_key, provider.tokenizer, self.args.stop_words
        )
        self.stop_matcher = stops.matcher()
        model, tokenizer = provider.model, provider.tokenizer
        self.cache = gen.pool.take(
            self.spec, self.prompt, lambda: make_prompt_cache(model, tokenizer, drafter=self.spec)
        )
        self.gen, self.n, self.first, self.tic = None, 0, 0.0, time.perf_counter()
        self.member: Member | None = None  # set while it is decoded in a batch

    def options(self) -> dict:
        """stream_generate's arguments for this request."""
        s, a = self.args.sampling, self.args
        return dict(
            max_tokens=a.max_tokens, temp=s.temperature, top_p=s.top_p, top_k=s.top_k,
            min_p=s.min_p, logits_processors=_make_logits_processors(a), seed=a.seed,
            prompt_cache=self.cache,
        )  # fmt: skip

    def emit(self, gen: Any) -> bool:
        """Hand one response to the handler; True when the request is done."""
        self.gen, self.n = gen, self.n + 1
        finish = "stop" if self.stop_matcher.advance(gen.token) else gen.finish_reason
        lp = gen.logprobs
        top = _format_top_logprobs(lp, self.args.top_logprobs, self.server.model_provider.tokenizer)
        self.rqueue.put(Response(gen.text, gen.token, lp[gen.token].item(), finish, top))
        if self.n == 1:
            self.ctx.prompt_cache_count = gen.stats.cached_tokens
            self.first = time.perf_counter() - self.tic
        return self.ctx._should_stop or finish is not None

    def cancelled(self) -> bool:
        return self.ctx._should_stop

    def finish(self) -> None:
        """Give the cache back; the usage figures and the end of the stream to the handler."""
        self.server.pool.give(self.spec, self.cache)
        if self.gen is None:  # left before its first token
            self.rqueue.put(None)
            return
        decode_s = time.perf_counter() - self.tic - self.first
        self.request.usage = usage(self.gen, self.spec, self.n, self.first, decode_s)
        m = self.member
        self.request.usage["batch_size"] = round(m.shared / m.steps, 2) if m and m.steps else 1.0
        log.info("request: %s", " ".join(f"{k}={v}" for k, v in self.request.usage.items()))
        log.info("memory: %s", " ".join(f"{k}={v}" for k, v in memory(self.server.pool).items()))
        self.rqueue.put(None)


class SpecResponseGenerator(ResponseGenerator):
    """Serves requests on the generation thread mlx-lm's handler talks to: up to
    `concurrency` decoded together (serve/batch.py) when the model allows, else one at a time
    in arrival order; a bad request is marked (`request.bad`) so the handler answers 400."""

    def __init__(
        self, model_provider: Any, pool: CachePool, drafter: str, concurrency: int = 1,
        queue: int = 64,
    ):  # fmt: skip
        self.pool, self.drafter, self._pool_key = pool, drafter, None
        self.concurrency, self.queue_limit = concurrency, queue
        self._held: tuple | None = None  # a request for another model, waiting for an empty batch
        self.decoding = 0  # requests being decoded now
        # starts the generation thread; mlx-lm's LRUPromptCache stays unused (its readers,
        # _generate and _serve_single, are replaced here): None, which its signature omits
        super().__init__(model_provider, None)  # type: ignore[arg-type]

    def waiting(self) -> int:
        """Requests not yet being decoded."""
        return self.requests.qsize() + (self._held is not None)

    def _load(self, args: Any) -> None:
        self.model_provider.load(args.model.model, args.model.adapter, args.model.draft)
        if self.model_provider.model_key != self._pool_key:
            self.pool.clear()
            self._pool_key = self.model_provider.model_key

    def _key(self, args: Any) -> tuple:
        """The model key mlx-lm's provider would load for `args` (without loading it)."""
        p, m = self.model_provider, args.model
        return (
            p._model_map.get(m.model, m.model),
            p._adapter_map.get(m.model, m.adapter),
            p._draft_model_map.get(m.draft, m.draft),
        )

    def _generate(self) -> None:
        self.model_provider.load_default()
        if self.concurrency > 1 and self._batchable():
            self._generate_batched()
        while not self._stop:
            item = self._next_request(timeout=0.1)
            if item is None:
                continue
            try:
                self._load(item[2])
            except Exception as e:
                item[0].put(e)
                continue
            self._serve_single(item, None)
        self.pool.clear()
        self.model_provider.reset()

    def _generate_batched(self) -> None:
        """Admit requests while there are free slots, then step every active one together."""
        batch = Batch()
        active: dict[int, _Request] = {}
        try:
            while not self._stop:
                self._admit(batch, active)
                self.decoding = len(batch.members)
                if not batch.members:
                    continue
                try:
                    done = batch.step()
                except Exception as e:  # a failed forward ends every request in it
                    log.exception("batched step failed")
                    done = list(batch.members)
                    for m in done:
                        active[id(m)].cache.reset()
                        active[id(m)].rqueue.put(e)
                        m.done = True
                    batch.drop_done()
                for m in done:
                    r = active.pop(id(m))
                    if m.error is None:
                        r.finish()
                        continue
                    r.cache.reset()
                    self.pool.give(r.spec, r.cache)
                    r.rqueue.put(m.error)
        finally:
            for m in batch.members:
                m.close()
                active.pop(id(m)).finish()

    def _admit(self, batch: Batch, active: dict[int, _Request]) -> None:
        """Join waiting requests while slots are free, at most one prefill between steps of a
        running batch; a request for another model waits until the batch is empty."""
        while len(batch.members) < self.concurrency:
            idle = not batch.members
            item, self._held = (self._held, None) if self._held and idle else (None, self._held)
            if item is None and self._held is None:
                item = self._next_request(timeout=0.1 if idle else None)
            if item is None:
                return
            if not idle and self._key(item[2]) != self.model_provider.model_key:
                self._held = item
                return
            member = self._join(item)
            if member is not None:
                batch.add(member[0])
                active[id(member[0])] = member[1]
                if not idle:  # one prefill between steps: the others keep decoding
                    return

    def _join(self, item: tuple) -> tuple[Member, _Request] | None:
        """Prefill a request alone and make it a batch member (None: refused, answered)."""
        rqueue, request, args = item
        r = None
        try:
            self._load(args)
            r = _Request(self, item)
            model, tokenizer = self.model_provider.model, self.model_provider.tokenizer
            decoder, ids = start_decoder(
                model, tokenizer, r.prompt, shared_forward=True, **r.options()
            )
            r.rqueue.put(r.ctx)
            r.member = join(decoder, ids, tokenizer, r.emit, r.cache, (), r.cancelled)
            return r.member, r
        except Exception as e:
            if r is not None:
                r.cache.reset()
                self.pool.give(r.spec, r.cache)
            request.bad = isinstance(e, AdaspecError)
            rqueue.put(e)
            return None

    def _batchable(self) -> bool:
        from ..targets import make_target
        from ..targets.batch import batch_unsupported

        why = batch_unsupported(make_target(self.model_provider.model))
        if why:
            log.warning("requests are served one at a time: %s cannot be batched", why)
        return not why

    def _serve_single(self, item: tuple, stream: Any) -> None:
        rqueue, request, _ = item
        try:
            self._serve(item)
        except Exception as e:
            request.bad = isinstance(e, AdaspecError)
            rqueue.put(e)

    def _prepare(self, request: Any, args: Any) -> tuple[list[int], str, GenerationContext]:
        # mlx-lm's provider starts with tokenizer = None, all mypy infers for it; a request is
        # prepared after _load, with the model's TokenizerWrapper there
        tokenizer = cast(TokenizerWrapper, self.model_provider.tokenizer)
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

    def _serve(self, item: tuple) -> None:
        self.decoding = 1
        try:
            self._serve_one(item)
        finally:
            self.decoding = 0

    def _serve_one(self, item: tuple) -> None:
        r = _Request(self, item)
        r.rqueue.put(r.ctx)
        model, tokenizer = self.model_provider.model, self.model_provider.tokenizer
        try:
            # stream_generate is typed an Iterator; it is a generator, closed here when the
            # request ends early
            responses = cast(
                Generator[SpecResponse, None, None],
                stream_generate(model, tokenizer, r.prompt, **r.options()),
            )
            with closing(responses):
                for gen in responses:
                    if r.emit(gen):
                        break
        except BaseException:
            self.pool.give(r.spec, r.cache)
            raise
        r.finish()


def kv_bytes(cache: Any) -> int:
    """Bytes a PromptCache's target KV cache holds (0 for anything else)."""
    target = getattr(cache, "target", None)
    return sum(c.nbytes for c in getattr(target, "cache", ()))


def memory(pool: CachePool) -> dict:
    """Where resident memory sits (MB): arrays alive (weights, KV caches), mlx's cache of freed
    buffers kept for reuse, and the pooled prompt caches' KV bytes."""
    import mlx.core as mx

    kv = pool.nbytes()
    return {
        "active_mb": round(mx.get_active_memory() / 2**20, 1),
        "buffer_cache_mb": round(mx.get_cache_memory() / 2**20, 1),
        "pool_kv_mb": round(kv / 2**20, 1),
        "pool_caches": len(pool.entries),
    }


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
