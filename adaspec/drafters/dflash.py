"""DFlash drafter: drafts a whole block in one pass, conditioned on the target's tap features.

Registry spec: ``dflash:DIR[,block=N][,window=N][,sink=N][,head=N][,weights=bf16]`` -- DIR is a
z-lab-format checkpoint folder (config.json + *.safetensors; it may not contain ',' here, use
`load()` for such paths); block overrides the checkpoint's block size, window/sink the attended
context (sink + recent), head the checkpoint's head token set (0: the full vocabulary, N: its N
most frequent ids); weights=bf16 drafts from bf16 copies of the drafter's own weight matrices and
of a restricted head's rows (never the target's embedding or full head, which the target reads).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import DrafterError
from ..kernels import arithmetic, attention, layers
from ..kernels.shadow import Shadows, resolve, shadow_model
from ..kernels.softmax import fast_logsumexp
from ..settings import Settings
from ..targets.base import TargetInfo, embedding_and_head
from .base import Draft, DraftContext
from .dflash_checkpoint import check_target, load_model, save_model
from .dflash_model import DFlashModel
from .restricted_head import DraftHead, KeptRows, head_subset
from .shipped import default_checkpoint
from .spec import DrafterArgs, Entry

log = logging.getLogger(__name__)

_GROW = 256  # context rows allocated at a time
DFLASH_WEIGHTS = ("auto", "fp32", "bf16", "q8")  # q4 copies are of GGUF stored weights only


class ContextCache:
    """Per-layer context keys/values (post-RoPE, at absolute positions) of every committed
    position but the newest. All rows are kept, so rollback across the window boundary is exact;
    the window is a row selection at draft time.

    New positions' tap features wait in `pending` and become keys/values in one batch when a
    draft needs them (or every FLUSH rows): while the policy keeps decoding plain, a step only
    queues a feature row instead of running the drafter's fc and K/V projections for it."""

    FLUSH = 64

    def __init__(self, model: DFlashModel):
        cfg = model.cfg
        self.model = model
        self._shape = (1, cfg.num_key_value_heads, 0, cfg.head_dim)
        self.keys = [mx.zeros(self._shape) for _ in range(cfg.num_hidden_layers)]
        self.values = [mx.zeros(self._shape) for _ in range(cfg.num_hidden_layers)]
        self.computed = 0  # rows whose keys/values are in the buffers
        self.pending: list[mx.array] = []  # (rows, taps * hidden) features, oldest first

    @property
    def length(self) -> int:
        return self.computed + sum(f.shape[0] for f in self.pending)

    def add(self, feats: mx.array) -> None:
        """Queue the tap features of the next positions."""
        self.pending.append(feats)
        if self.length - self.computed >= self.FLUSH:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        feats = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending)
        self.pending = []
        self.append(self.model.context_kv(feats, self.computed))

    def append(self, kv: list[tuple[mx.array, mx.array]]) -> None:
        m = kv[0][0].shape[2]
        end = self.computed + m
        if end > self.keys[0].shape[2]:
            self._grow(-(-end // _GROW) * _GROW)
        for i, (k, v) in enumerate(kv):
            self.keys[i][..., self.computed : end, :] = k
            self.values[i][..., self.computed : end, :] = v
        self.computed = end
        # computed while the controller finishes its step; bounds the graph if nobody drafts
        mx.async_eval(self.keys, self.values)

    def _grow(self, cap: int) -> None:
        n, h, _, d = self._shape
        for buf in (self.keys, self.values):
            for i, old in enumerate(buf):
                new = mx.zeros((n, h, cap, d))
                new[..., : self.computed, :] = old[..., : self.computed, :]
                buf[i] = new

    def truncate(self, length: int) -> None:
        length = max(0, length)
        if length <= self.computed:
            self.computed, self.pending = length, []
            return
        keep, rows = [], self.computed
        for f in self.pending:
            if rows >= length:
                break
            keep.append(f[: length - rows])
            rows += keep[-1].shape[0]
        self.pending = keep

    def view(self, window: int, sink: int) -> tuple[list[tuple[mx.array, mx.array]], np.ndarray]:
        """Attended rows: all if they fit the window, else the first `sink` + the most recent."""
        self.flush()
        S = self.computed
        if S <= window:
            rows = [(k[..., :S, :], v[..., :S, :]) for k, v in zip(self.keys, self.values)]
            return rows, np.arange(S)
        r = S - (window - sink)

        def pick(a: mx.array) -> mx.array:
            return mx.concatenate([a[..., :sink, :], a[..., r:S, :]], axis=2)

        rows = [(pick(k), pick(v)) for k, v in zip(self.keys, self.values)]
        return rows, np.concatenate([np.arange(sink), np.arange(r, S)])


class DFlashDrafter:
    """DraftModel over a DFlashModel bound to the target's embedding and output head."""

    name = "dflash"

    def __init__(
        self,
        model: DFlashModel,
        info: TargetInfo,
        *,
        block: int = 0,
        window: int = 2048,
        sink: int = 4,
        head: int | None = None,
        shadows: Shadows | None = None,
    ):
        """head: None uses the checkpoint's head token set as stored (the full vocabulary when
        it has none), 0 the full vocabulary, N > 0 the set's first (most frequent) N ids.
        shadows: the model's bf16 shadows (weights=bf16); the restricted head's rows then get
        theirs too."""
        cfg = model.cfg
        check_target(cfg, info)
        self.block = block or cfg.block_size
        if not 2 <= self.block <= 256:
            raise DrafterError(
                f"dflash block={block} is invalid; accepted: 0 (the checkpoint's "
                f"{cfg.block_size}) or 2..256"
            )
        if not 0 <= sink < window:
            raise DrafterError(
                f"dflash context window={window}, sink={sink} are invalid; "
                "accepted: 0 <= sink < window"
            )
        self.model, self.cfg, self.window, self.sink = model, cfg, window, sink
        self.needs_taps = cfg.target_layer_ids
        self.vocab_size = cfg.vocab_size
        self._embed, project = embedding_and_head(info.model)
        self.head = DraftHead(project, cfg.vocab_size, head_subset(model.head_token_ids, head))
        self.shadows = shadows  # kept alive while this drafts
        # only a restricted head's rows are the drafter's own; a full head is the target's
        kept = self.head.projection if isinstance(self.head.projection, KeptRows) else None
        self.head_shadows = Shadows([kept.weight]) if shadows and kept else None
        self.tokens: list[int] = []
        self.cache = ContextCache(model)

    def _features(self, ctx: DraftContext, rows: int, where: str) -> mx.array:
        f = ctx.features
        if f is None or f.ndim != 2 or f.shape[0] < rows:
            got = None if f is None else tuple(f.shape)
            raise DrafterError(
                f"dflash {where} got tap features of shape {got}; accepted: at least {rows} rows "
                f"of the target layers {list(self.needs_taps)} (ctx.features)"
            )
        return f[f.shape[0] - rows :]

    def _extend(self, tokens: Sequence[int], ctx: DraftContext, where: str) -> None:
        # The context holds every committed position but the newest: the features that arrive
        # for the newest token are the ones of the position before it.
        self.tokens += [int(t) for t in tokens]
        need = max(len(self.tokens) - 1, 0) - self.cache.length
        if need > 0:
            feats = self._features(ctx, need, where)
            self.cache.add(feats)

    def prefill(self, prompt_tokens: Sequence[int], ctx: DraftContext) -> None:
        self.tokens = []
        self.cache = ContextCache(self.model)
        self._extend(prompt_tokens, ctx, "prefill")

    def advance(self, committed_tokens: Sequence[int], ctx: DraftContext) -> None:
        self._extend(committed_tokens, ctx, "advance")

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self.tokens):
            raise DrafterError(
                f"dflash rollback({n}) out of range; accepted: 0..{len(self.tokens)}"
            )
        del self.tokens[len(self.tokens) - n :]
        self.cache.truncate(len(self.tokens) - 1)

    def hidden(self, k: int) -> mx.array:
        """(k, d) final-normed drafter states of the k positions after the last committed
        token."""
        if not self.tokens:
            raise DrafterError("dflash draft() before prefill(); accepted: prefill a prompt first")
        ids = mx.array([self.tokens[-1]] + [self.cfg.mask_token_id] * (self.block - 1))
        x = self._embed(ids)[None].astype(mx.float32)
        ctx, pos = self.cache.view(self.window, self.sink)
        return self.model(x, ctx, len(self.tokens) - 1, pos)[0, 1 : k + 1]

    def block_logits(self, k: int) -> mx.array:
        """(k, n) float32 logits of the k positions after the last committed token over the
        head's tokens: the whole vocabulary (n = V), or head.ids in their order."""
        return self.head.logits(self.hidden(k))

    def draft(self, ctx: DraftContext) -> Draft:
        k = min(self.block - 1, ctx.max_draft)
        if k <= 0:
            return Draft()
        h = self.hidden(k)
        if ctx.tree_nodes > 1:
            return self._tree(h, ctx.tree_nodes, ctx.temperature)
        if ctx.temperature <= 0:
            return Draft(self.head.greedy(h))
        return Draft(*self.head.sample(h, ctx.temperature, ctx.rng))

    def draft_ids(self, ctx: DraftContext) -> mx.array | None:
        """The greedy chain draft() proposes, unevaluated (LazyDrafter)."""
        k = min(self.block - 1, ctx.max_draft)
        if k <= 0 or ctx.tree_nodes > 1 or ctx.temperature > 0:
            return None
        return self.head.greedy_ids(self.hidden(k))

    def _tree(self, h: mx.array, budget: int, temperature: float) -> Draft:
        """Best-first by cumulative probability under the drafter's per-position distributions
        (each position drafted once for the whole block, so every branch shares them), within
        `budget` nodes; deterministic, so under sampling the target's draws decide (lossless)."""
        logits = self.head.logits(h)
        if temperature > 0:
            logits = logits / temperature
        width = min(budget, self.TREE_WIDTH)
        top = mx.argsort(-logits, axis=-1)[:, :width]
        logp = mx.take_along_axis(logits - fast_logsumexp(logits), top, -1)
        ids = np.array(top)
        if self.head.ids is not None:
            ids = self.head.ids[ids]
        return Draft(*best_first(ids, np.array(logp, dtype=np.float64), budget))

    TREE_WIDTH = 4  # candidates per position a tree considers

    def save(self, path: str | Path, dtype: str = "float32") -> Path:
        """The drafter's checkpoint: weights and the model's stored head token set, if any."""
        return save_model(self.model, path, dtype)


def best_first(
    ids: np.ndarray, logp: np.ndarray, budget: int
) -> tuple[tuple[int, ...], None, tuple[int, ...]]:
    """(tokens, None, parents) of the `budget` most probable nodes of the tree whose level j
    offers ids[j] (each with log-probability logp[j], best first) under every node above it."""
    import heapq

    k, width = ids.shape
    heap = [(-float(logp[0, j]), j, 0, j, -1) for j in range(width)]  # score, order, pos, j, parent
    tokens: list[int] = []
    parents: list[int] = []
    order = width
    while heap and len(tokens) < budget:
        neg, _, pos, j, parent = heapq.heappop(heap)
        tokens.append(int(ids[pos, j]))
        parents.append(parent)
        if pos + 1 < k:
            for c in range(width):
                heapq.heappush(
                    heap, (neg - float(logp[pos + 1, c]), order, pos + 1, c, len(tokens) - 1)
                )
                order += 1
    return tuple(tokens), None, tuple(parents)


def load(
    path: str | Path,
    info: TargetInfo,
    *,
    block: int = 0,
    window: int = 2048,
    sink: int = 4,
    head: int | None = None,
    weights: str = "fp32",
) -> DFlashDrafter:
    """A DFlashDrafter from a z-lab-format checkpoint folder, bound to the target `info`."""
    model, shadows = shared_model(path, info, resolve(weights, "dflash", DFLASH_WEIGHTS))
    return DFlashDrafter(
        model, info, block=block, window=window, sink=sink, head=head, shadows=shadows
    )


_MODELS: dict[tuple, tuple[DFlashModel, Shadows | None]] = {}
_MODELS_LOCK = threading.Lock()
MODELS_KEPT = 4


def _stamp(folder: Path) -> tuple:
    """What identifies a checkpoint's files on disk: name, inode, size and mtime of each."""
    files = sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors"))
    stats = [(f.name, f.stat()) for f in files]
    return tuple((n, s.st_ino, s.st_size, s.st_mtime_ns) for n, s in stats)


def shared_model(
    path: str | Path, info: TargetInfo, weights: str = "fp32"
) -> tuple[DFlashModel, Shadows | None]:
    """The checkpoint's weights, read once per process while its files are unchanged: every
    drafter made from one folder (generations, the server's pooled prompt caches) shares
    them; each DFlashDrafter keeps its own context cache. The model is never written to.
    weights=bf16 gets a copy of its own whose weight matrices have bf16 shadows; weights=q8
    one whose GEMMs run in the 8-bit arithmetic."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        load_model(folder, info)  # raises the clear error
    key = (str(folder.resolve()), _stamp(folder), weights)
    with _MODELS_LOCK:
        entry = _MODELS.get(key)
        if entry is None:
            model = load_model(folder, info)
            if attention.enabled():  # RoPE / RMSNorm / Linear twins, stock mlx's bits
                layers.install(model)
            if weights == "q8":  # its own matrices (the target's embedding and head are not)
                arithmetic.apply(model, "q8")
            entry = (model, shadow_model(model) if weights == "bf16" else None)
            while len(_MODELS) >= MODELS_KEPT:
                _MODELS.pop(next(iter(_MODELS)))
            _MODELS[key] = entry
    return entry


def checkpoint_dir(folder: str | None, info: TargetInfo, who: str) -> Path:
    if folder:
        return Path(folder)
    default = default_checkpoint(info)
    if default is None:
        raise DrafterError(
            f"{who} needs a DFlash checkpoint folder ({who}:DIR[,block=N,...]); no default "
            f"checkpoint ships for target {info.model_type or '?'} "
            f"(hidden {info.hidden_size}, vocab {info.vocab_size})"
        )
    return default


def factory(args: DrafterArgs, info: TargetInfo, settings: Settings) -> DFlashDrafter:
    return load(
        checkpoint_dir(args.path, info, "dflash"),
        info,
        block=args.get("block", settings.dflash_block),
        window=args.get("window", settings.dflash_ctx_window),
        sink=args.get("sink", settings.dflash_ctx_sink),
        head=args.get("head", None),
        weights=args.get("weights", "fp32"),
    )


ENTRY = Entry(
    factory,
    {"block": int, "window": int, "sink": int, "head": int, "weights": str},
    path="checkpoint folder",
)
