"""Draft-model drafter: a small LM sharing the target's tokenizer drafts token by token from its
own KV cache, which is trimmed back to the committed prefix before each draft.

Registry spec: ``draft-model:PATH_OR_NAME[,min_p1=F][,q=0][,head=N][,weights=W]`` -- an
mlx-lm folder, a .gguf file or a catalogue name (loaded once per process and shared); min_p1
stops a draft at the first token whose draft probability is below F; q=0 withholds the draft
probabilities, so sampled drafts are verified by sample-and-match instead of rejection sampling
(for comparisons); head=N computes the draft model's output projection for N token ids only (the
lowest ids, which a byte-level BPE gives its most frequent merges, and the end-of-sequence ids):
a cheaper draft that can propose no other token; weights=bf16 drafts from bf16 copies of the
model's weight matrices (adaspec/kernels/shadow.py): fewer bytes to read per draft token, for a
little acceptance; weights=q8 runs its GEMMs in the 8-bit arithmetic; weights=q4 also reads
4-bit copies of a GGUF draft model's wider stored weights (kernels/requant.py) (auto,
ADASPEC_DRAFT_MODEL_WEIGHTS's default: q4 on a CPU with AVX-512 VNNI, q8 there for a model
without stored weights, else bf16 when the routed kernel runs; fp32: the weights as loaded).
"Same vocabulary" is defined in docs/drafters.md.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from .. import distributions
from ..errors import DrafterError, DrafterMismatchError
from ..kernels import arithmetic, requant
from ..kernels.shadow import Shadows, resolve, shadow_model
from ..kernels.softmax import fast_logsumexp
from ..sampling_params import SamplingParams, sample
from ..settings import Settings
from ..targets.base import TargetInfo, embedding_and_head, inner_model
from .base import Draft, DraftContext
from .restricted_head import KeptRows, restricted_projection, select_head_tokens
from .spec import DrafterArgs, Entry

log = logging.getLogger(__name__)

# more pending tokens than this (committed while floored) are fed before drafting, timed apart
CATCH_UP = 4


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    get = getattr(tokenizer, "get_vocab", None) if tokenizer is not None else None
    return dict(get()) if get is not None else None


# pairs of tokenizer objects found to agree (held, so their ids stay theirs): a drafter is made
# per request, and reading two vocabularies of 150k tokens takes ~0.15 s each time
_AGREEING: dict[tuple[int, int], tuple[Any, Any]] = {}
AGREEING_KEPT = 8


def check_vocab(draft: TargetInfo, target: TargetInfo) -> None:
    """Same vocabulary: both tokenizers map every token string to the same id (embedding row
    counts may differ, e.g. padding); without both tokenizers, equal row counts. A pair of
    tokenizer objects that agreed once is not read again."""
    key = (id(draft.tokenizer), id(target.tokenizer))
    both = draft.tokenizer is not None and target.tokenizer is not None
    if both and key in _AGREEING:
        return
    _compare_vocab(draft, target)
    if both:
        if len(_AGREEING) >= AGREEING_KEPT:
            del _AGREEING[next(iter(_AGREEING))]
        _AGREEING[key] = (draft.tokenizer, target.tokenizer)


def _compare_vocab(draft: TargetInfo, target: TargetInfo) -> None:
    dv, tv = _vocab(draft.tokenizer), _vocab(target.tokenizer)
    sizes = (
        f"the draft model has {draft.vocab_size} embedding rows"
        + (f" and {len(dv)} tokenizer tokens" if dv is not None else "")
        + f", the target {target.vocab_size} rows"
        + (f" and {len(tv)} tokenizer tokens" if tv is not None else "")
    )
    if dv is None or tv is None:
        if draft.vocab_size != target.vocab_size:
            raise DrafterMismatchError(
                f"draft-model vocabulary mismatch: {sizes}; accepted: equal row counts when a "
                "tokenizer is missing, else the target's tokenizer"
            )
        return
    if dv != tv:
        differ = [t for t in dv.keys() | tv.keys() if dv.get(t) != tv.get(t)]
        example = sorted(differ, key=lambda t: min(dv.get(t, 1 << 62), tv.get(t, 1 << 62)))[0]
        raise DrafterMismatchError(
            f"draft-model tokenizer mismatch: {sizes}; {len(differ)} tokens have different ids "
            f"(e.g. {example!r}: draft {dv.get(example)}, target {tv.get(example)}); "
            "accepted: a draft model with the target's tokenizer (same model family)"
        )


class DraftLM:
    """DraftModel over any mlx-lm causal LM whose caches can be trimmed.

    Cache invariant: `cached` lists the ids in the drafter's KV cache; it agrees with the
    committed view on its first `_synced` positions. A draft first trims the cache to the
    longest agreeing prefix (at most all committed tokens but the newest), feeds the rest in
    one forward, then one token per forward. Proposed ids are < min(draft rows, target rows).
    """

    name = "draft-model"
    needs_taps: tuple[int, ...] = ()

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        target: TargetInfo,
        *,
        min_p1: float = 0.0,
        prefill_step: int = 2048,
        send_q: bool = True,
        head: int = 0,
        shadows: Shadows | None = None,
    ):
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        from ..targets.base import target_info

        info = target_info(model, tokenizer)
        check_vocab(info, target)
        if not 0 <= min_p1 < 1:
            raise DrafterError(f"draft-model min_p1={min_p1} is invalid; accepted: 0 <= F < 1")
        self.model, self.min_p1, self.prefill_step = model, min_p1, prefill_step
        self.send_q = send_q
        self.shadows = shadows  # bf16 copies of the model's weights, alive while this drafts
        self.vocab_size = target.vocab_size  # q rows have the target's width
        self.n_ids = min(info.vocab_size, target.vocab_size)
        self._head = self._restricted_head(head, target, info.vocab_size) if head else None
        # head=N gathers its rows into an array of its own: shadowed like the model's matrices
        kept = self._head[1] if self._head else None
        self.head_shadows = (
            Shadows([kept.weight]) if shadows is not None and isinstance(kept, KeptRows) else None
        )
        self._make_cache = make_prompt_cache
        self.cache = make_prompt_cache(model)
        if not can_trim_prompt_cache(self.cache):
            kinds = sorted({type(c).__name__ for c in self.cache if not c.is_trimmable()})
            raise DrafterError(
                f"draft model {type(model).__name__} has cache layers that cannot be trimmed "
                f"({', '.join(kinds)}); accepted: models with trimmable (KV) caches"
            )
        self.tokens: list[int] = []
        self.cached: list[int] = []
        self._synced = 0

    def _restricted_head(
        self, head: int, target: TargetInfo, rows: int
    ) -> tuple[Any, Any, mx.array]:
        """(decoder, projection onto the kept ids, the kept ids) for head=N; `rows`: the draft
        model's own embedding rows (padded checkpoints have more than the tokenizer's ids)."""
        if not 0 < head <= self.n_ids:
            raise DrafterError(
                f"draft-model head={head} is invalid; accepted: 0 (the whole vocabulary) or "
                f"1..{self.n_ids}"
            )
        tok = target.tokenizer
        eos = getattr(tok, "eos_token_ids", None) or [getattr(tok, "eos_token_id", None)]
        always = [int(i) for i in eos if i is not None and 0 <= int(i) < self.n_ids]
        ids = select_head_tokens(np.zeros(self.n_ids), head, always)
        project = restricted_projection(embedding_and_head(self.model)[1], ids, rows)
        return inner_model(self.model), project, mx.array(ids)

    # ---- committed view ------------------------------------------------------------------
    def prefill(self, prompt_tokens: Sequence[int], ctx: DraftContext) -> None:
        self.tokens = [int(t) for t in prompt_tokens]
        self.cache, self.cached, self._synced = self._make_cache(self.model), [], 0
        head = self.tokens[:-1]
        for start in range(0, len(head), self.prefill_step):
            self._catch_up(head[start : start + self.prefill_step])
        self._synced = len(self.cached)

    def advance(self, committed_tokens: Sequence[int], ctx: DraftContext) -> None:
        self.tokens += [int(t) for t in committed_tokens]

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self.tokens):
            raise DrafterError(
                f"draft-model rollback({n}) out of range; accepted: 0..{len(self.tokens)}"
            )
        del self.tokens[len(self.tokens) - n :]
        self._synced = min(self._synced, len(self.tokens))

    # ---- cache ---------------------------------------------------------------------------
    def _pending(self) -> list[int]:
        """Trim the cache to the committed prefix it holds (never the newest token) and
        return the committed tokens still to feed (at least one)."""
        if not self.tokens:
            raise DrafterError("draft-model draft() before prefill(); accepted: prefill first")
        limit = min(len(self.cached), len(self.tokens) - 1)
        n = min(self._synced, limit)
        while n < limit and self.cached[n] == self.tokens[n]:
            n += 1
        drop = len(self.cached) - n
        if drop:
            got = [c.trim(drop) for c in self.cache][0]
            if got != drop:
                raise DrafterError(f"draft-model cache trimmed {got} of {drop} positions")
            del self.cached[n:]
        self._synced = len(self.tokens)
        return self.tokens[n:]

    def _forward(self, ids: Sequence[int] | mx.array) -> mx.array:
        """Feed ids; (n_ids,) float32 logits of the position after the last one."""
        x = ids if isinstance(ids, mx.array) else mx.array(list(ids), dtype=mx.uint32)
        if self._head is None:
            logits = self.model(x.reshape(1, -1), cache=self.cache)[0, -1]
            return logits[: self.n_ids].astype(mx.float32)
        decoder, project, kept = self._head  # ids outside the head set get -inf
        # the last position as (1, 1, hidden): mlx runs the projection of a 1-D or 2-D input
        # 2-3x slower here (Qwen2.5-0.5B, 65,536 ids: 15.8 / 12.1 / 5.3 ms for 1-D / 2-D / 3-D)
        h = decoder(x.reshape(1, -1), cache=self.cache)[:, -1:]
        full = mx.full((self.n_ids,), -mx.inf, dtype=mx.float32)
        full[kept] = project(h).reshape(-1).astype(mx.float32)
        return full

    def next_logits(self) -> mx.array:
        """(n_ids,) logits for the token after the committed sequence (tests, diagnostics)."""
        feed = self._pending()
        self.cached += feed
        return self._forward(feed)

    # ---- drafting ------------------------------------------------------------------------
    def draft(self, ctx: DraftContext) -> Draft:
        k = ctx.max_draft
        if k <= 0:
            return Draft()
        params = ctx.sampling
        if params is None and ctx.temperature > 0:
            params = SamplingParams(temp=ctx.temperature)
        feed = self._pending()
        setup_s = self._catch_up(feed[:-1]) if len(feed) > CATCH_UP else 0.0
        feed = feed[-1:] if setup_s else feed
        self.cached += feed
        if (params is None or params.greedy) and ctx.tree_nodes > k and not self.min_p1:
            toks, parents = self._greedy_tree(feed, k, ctx.tree_nodes)
            self.cached += toks[: k - 1]
            return Draft(tuple(toks), parents=tuple(parents), setup_s=setup_s)
        if params is None or params.greedy:
            toks, fed = self._greedy(feed, k)
            q = None
        else:
            toks, q, fed = self._sampled(feed, k, params, ctx.rng)
        self.cached += toks[:fed]
        return Draft(tuple(toks), q if self.send_q else None, setup_s=setup_s)

    def _catch_up(self, tokens: list[int]) -> float:
        """Feed tokens committed while no draft was asked for (a floor); returns its seconds,
        which the policy does not hold against speculating (Draft.setup_s)."""
        t0 = time.perf_counter()
        self.model(mx.array(tokens, dtype=mx.uint32)[None], cache=self.cache)
        mx.eval([c.state for c in self.cache])  # the logits are never read, so never computed
        self.cached += tokens
        return max(time.perf_counter() - t0, 1e-9)

    def _greedy(self, feed: list[int], k: int) -> tuple[list[int], int]:
        """Argmax chain; lazy (one sync at the end) unless min_p1 needs each probability.
        Returns the tokens and how many of them were fed to the cache."""
        x: Sequence[int] | mx.array = feed
        out: list[mx.array] = []
        for i in range(k):
            logits = self._forward(x)
            tok = mx.argmax(logits, keepdims=True)
            if self.min_p1 > 0 and i > 0:
                p1 = mx.exp(mx.max(logits) - fast_logsumexp(logits)[..., 0])
                if float(np.array(p1)) < self.min_p1:
                    return _ids(out), len(out)
            out.append(tok)
            mx.async_eval(tok)
            x = tok
        return _ids(out), k - 1

    TREE_WIDTH = 4  # choices per position a tree may offer

    def _greedy_tree(self, feed: list[int], k: int, budget: int) -> tuple[list[int], list[int]]:
        """The argmax chain, plus the 2nd..4th choices at its positions as leaves, the likeliest
        first (the chance the chain reaches the position times the choice's probability), within
        `budget` nodes. The leaves cost no forward: the model only runs along the chain."""
        x: Sequence[int] | mx.array = feed
        ids, probs = [], []
        w = min(self.TREE_WIDTH, self.n_ids)
        for _ in range(k):
            logits = self._forward(x)
            top = mx.argpartition(-logits, w - 1)[:w]
            p = mx.softmax(logits)[top]
            order = mx.argsort(-p)
            top, p = top[order], p[order]
            ids.append(top)
            probs.append(p)
            mx.async_eval(top, p)
            x = top[:1]
        top_ids, top_p = np.array(mx.stack(ids)), np.array(mx.stack(probs), dtype=np.float64)
        reach = np.concatenate([[1.0], np.cumprod(top_p[:, 0])[:-1]])
        leaves = sorted(
            ((reach[j] * top_p[j, c], j, c) for j in range(k) for c in range(1, w)), reverse=True
        )[: budget - k]
        tokens = [int(t) for t in top_ids[:, 0]]
        parents = list(range(-1, k - 1))
        for _, j, c in sorted(leaves, key=lambda x: (x[1], -x[0])):
            tokens.append(int(top_ids[j, c]))
            parents.append(j - 1)
        return tokens, parents

    def _sampled(
        self, feed: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> tuple[list[int], np.ndarray, int]:
        """Sample each token from q = the target's sampler applied to the draft's logits."""
        x: Sequence[int] = feed
        toks: list[int] = []
        rows: list[np.ndarray] = []
        fed = k - 1
        for i in range(k):
            q = self._q(self._forward(x), params)
            if self.min_p1 > 0 and i > 0 and q.max() < self.min_p1:
                fed = i
                break
            toks.append(sample(q, rng.random()))
            rows.append(q)
            x = toks[-1:]
        wide = np.zeros((len(rows), self.vocab_size))
        wide[:, : self.n_ids] = np.stack(rows)
        return toks, wide, fed

    @staticmethod
    def _q(logits: mx.array, params: SamplingParams) -> np.ndarray:
        p = distributions.probs(distributions.logprobs(logits[None]), params)[0]
        q = np.asarray(p, dtype=np.float64)
        return q / q.sum()


def _ids(tokens: list[mx.array]) -> list[int]:
    return [int(t) for t in np.array(mx.concatenate(tokens))]


@functools.lru_cache(maxsize=2)
def load_shared(
    path_or_name: str, settings: Settings, weights: str = "fp32", required: bool = True
) -> tuple[Any, Any, Shadows | None]:
    """(model, tokenizer, its bf16 shadows or None) of a draft model, loaded once per process
    and weights kind (generations and the bench share them, each DraftLM has its own cache; the
    bench's mlx-lm peer drafts with the fp32 one, whose matrices have no shadows). q4 not
    `required` (what auto picks): plain q8 where the model has no stored weights to copy."""
    from ..targets.loader import load

    log.info("loading draft model %s (%s weights)", path_or_name, weights)
    model, tokenizer = load(path_or_name, settings=settings)  # on the fast paths, as any load
    stored = getattr(model, "adaspec_stored", None) is not None
    if weights == "q4" and (required or stored):  # 4-bit copies of its wider weights, then q8
        replaced, released = requant.requantize(model)
        log.info("draft model: %d matrices to Q4_1, %.0f MB fewer", replaced, released / 1e6)
    if weights in ("q8", "q4"):  # a model of its own (loaded per weights kind): not the target
        arithmetic.apply(model, "q8")
    return model, tokenizer, shadow_model(model) if weights == "bf16" else None


def factory(args: DrafterArgs, info: TargetInfo, settings: Settings) -> DraftLM:
    if not args.path:
        raise DrafterError(
            "draft-model needs a model: draft-model:PATH_OR_NAME[,min_p1=F][,q=0]; accepted: an "
            "mlx-lm folder, a .gguf file or a catalogue name sharing the target's tokenizer"
        )
    requested = args.get("weights", settings.draft_model_weights)
    weights = resolve(requested, "draft-model")
    model, tokenizer, shadows = load_shared(args.path, settings, weights, requested != "auto")
    return DraftLM(
        model,
        tokenizer,
        info,
        min_p1=args.get("min_p1", settings.draft_model_min_p1),
        prefill_step=settings.prefill_step,
        send_q=args.get("q", True),
        head=args.get("head", 0),
        shadows=shadows,
    )


ENTRY = Entry(factory, {"min_p1": float, "q": bool, "head": int, "weights": str}, path="model")
