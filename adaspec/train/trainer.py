"""Training a DFlash drafter against a frozen target: batched block loss over cached tap
features and target labels, AdamW with warm-up + cosine and clipping, held-out tau, resumable
checkpoints."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from ..drafters.dflash_model import DFlashConfig, DFlashModel
from ..kernels import stored
from ..targets.base import embedding_and_head
from .data import TargetLabels, TrainSeq, load_features, load_labels
from .loss import block_objective
from .objective import (
    TrainingError,
    accepted_lengths,
    default_gamma,
    group_mask,
    label_counts,
    make_blocks,
    position_weights,
    sample_anchors,
)
from .recipe import Hyper

log = logging.getLogger(__name__)


@dataclass
class History:
    """What the model card and the plot report: per-step loss, per-epoch held-out metrics."""

    step: int = 0
    epoch: int = 0
    loss: list[tuple[int, float]] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)


class Head:
    """The frozen target's embedding and output projection, shared with inference; `rows`
    restricts the projection to some token ids (the training loss over a data vocabulary)."""

    def __init__(self, target: Any, rows: np.ndarray | None = None):
        self.embed, self.project = embedding_and_head(target)
        self.rows = self.weight = self._index = None
        if rows is not None:
            self.rows = mx.array(rows.astype(np.int32))
            self.weight = _head_weight(self.embed, self.project)[self.rows]
            index = np.zeros(int(rows.max()) + 1, dtype=np.int32)
            index[rows] = np.arange(len(rows), dtype=np.int32)
            self._index = mx.array(index)
        elif stored.lookup(getattr(self.project, "__self__", self.project).weight) is not None:
            # a head at its stored bits serves GEMMs of its own shape only; the loss's gradient
            # needs its transpose too, so training reads the fp32 expansion
            self.weight = _head_weight(self.embed, self.project)

    def logits(self, h: mx.array) -> mx.array:
        """Logits over the full vocabulary, or over `rows` (in their order)."""
        return self.project(h) if self.weight is None else h @ self.weight.T

    def labels(self, token_ids: mx.array) -> mx.array:
        """Token ids as indices into the columns `logits` returns (ids outside `rows` are not
        allowed)."""
        return token_ids if self._index is None else self._index[token_ids]


def _head_weight(embed: Any, project: Any) -> mx.array:
    """(V, d) float weight of the output projection (the embedding's when tied)."""
    owner = getattr(project, "__self__", project)  # a tied head is embed.as_linear
    if "scales" in owner or not hasattr(owner, "weight"):
        raise TrainingError(
            f"vocab='data' needs an unquantized output projection; {type(owner).__name__} is "
            "quantized or has no weight; accepted: vocab='full' for this target"
        )
    return stored.dense(owner.weight).astype(mx.float32)


def data_vocab(labels: Sequence[TargetLabels], soft: bool) -> np.ndarray:
    """Sorted token ids the loss can meet: the greedy labels (and the top-k ids when the soft
    term is on)."""
    parts = [lab.greedy for lab in labels]
    if soft:
        parts += [lab.top_ids.reshape(-1) for lab in labels]
    return np.unique(np.concatenate(parts))


def _padded(feats: list[np.ndarray]) -> mx.array:
    T = max(len(f) for f in feats)
    out = np.zeros((len(feats), T, feats[0].shape[1]), dtype=feats[0].dtype)
    for i, f in enumerate(feats):
        out[i, : len(f)] = f
    return mx.array(out)


def batch_arrays(
    seqs: Sequence[TrainSeq],
    feats: list[np.ndarray],
    labels: list[TargetLabels],
    anchors: list[np.ndarray],
    cfg: DFlashConfig,
    soft: bool = False,
) -> dict[str, mx.array]:
    """Everything one loss evaluation needs, for blocks of several sequences at once. Every
    sequence gets A = the most anchors of any (padding blocks at anchor 0, never scored);
    `real` (N,) picks the real blocks, in order, out of the S*A. With `soft`, also the target's
    top-k ids and log-probs at each draft position."""
    A = max(len(a) for a in anchors)
    padded = np.zeros((len(anchors), A), dtype=np.int64)
    real: list[int] = []
    for i, a in enumerate(anchors):
        padded[i, : len(a)] = a
        real.extend(i * A + j for j in range(len(a)))
    blocks = [
        make_blocks(s.tokens, lab.greedy, a, cfg.block_size, cfg.mask_token_id)
        for s, lab, a in zip(seqs, labels, padded)
    ]
    F = _padded(feats)
    keep = np.array(real)
    out = {
        "features": F,
        "anchors": mx.array(padded.reshape(-1)),
        "real": mx.array(keep),
        "inputs": mx.array(np.concatenate([b.inputs for b in blocks])),
        "labels": mx.array(np.concatenate([b.labels for b in blocks])[keep]),
        "valid": mx.array(np.concatenate([b.valid for b in blocks])[keep]),
        "mask": mx.array(group_mask(padded, F.shape[1], cfg.block_size, cfg.causal(0))),
    }
    if soft:
        ids = np.concatenate([lab.top_ids[b.source] for lab, b in zip(labels, blocks)])
        lp = np.concatenate([lab.top_logprobs[b.source] for lab, b in zip(labels, blocks)])
        out["top_ids"], out["top_logprobs"] = mx.array(ids[keep]), mx.array(lp[keep])
    return out


def block_logits(model: DFlashModel, head: Head, b: dict[str, mx.array]) -> mx.array:
    """(N, B-1, V) logits of every real block's draft positions (V = len(head.rows) when the
    head is restricted; the labels must then be indices into head.rows)."""
    ctx = model.context_kv(b["features"], 0)
    x = head.embed(b["inputs"]).astype(mx.float32)
    h = model.blocks(x, ctx, b["anchors"], b["mask"])
    return head.logits(h[b["real"], 1:]).astype(mx.float32)


def block_loss(
    model: DFlashModel, head: Head, b: dict[str, mx.array], w: mx.array, soft: float = 0.0
) -> mx.array:
    """Position-weighted loss over the valid draft positions (see loss.block_objective)."""
    weight = w[None] * b["valid"]
    logits = block_logits(model, head, b)
    return block_objective(
        logits, b["labels"], weight, soft, b.get("top_ids"), b.get("top_logprobs")
    )


def anchors_for(rng: np.random.Generator, s: TrainSeq, hyper: Hyper) -> np.ndarray:
    """anchors_per_seq in the response and prompt_anchors in the prompt; a sequence without a
    response takes all of them in its text. Never at 0 (a block needs some context)."""
    if not s.has_response:
        return sample_anchors(rng, 1, len(s.tokens), hyper.anchors_per_seq + hyper.prompt_anchors)
    return np.concatenate(
        [
            sample_anchors(rng, 1, s.prompt_len, hyper.prompt_anchors),
            sample_anchors(rng, s.prompt_len, len(s.tokens) - 1, hyper.anchors_per_seq),
        ]
    )


class Trainer:
    def __init__(
        self,
        model: DFlashModel,
        target: Any,
        train: Sequence[TrainSeq],
        heldout: Sequence[TrainSeq],
        features_dir: Path,
        state_dir: Path,
        hyper: Hyper,
    ):
        if not train:
            raise TrainingError("no training sequences; accepted: at least one")
        self.model, self.head, self.hyper = model, Head(target), hyper
        self.train, self.heldout = list(train), list(heldout)
        self.features_dir, self.state_dir = features_dir, state_dir
        self.labels = {
            s.key: load_labels(features_dir, s, hyper.label_k) for s in [*self.train, *self.heldout]
        }
        self.loss_head = self.head
        if hyper.vocab == "data":
            rows = data_vocab([self.labels[s.key] for s in self.train], hyper.soft > 0)
            self.loss_head = Head(target, rows)
        cfg = model.cfg
        self.width = len(cfg.target_layer_ids) * cfg.hidden_size
        self.weights = mx.array(
            position_weights(cfg.block_size, hyper.gamma or default_gamma(cfg.block_size)),
            dtype=mx.float32,
        )
        self.steps_per_epoch = math.ceil(len(self.train) / hyper.seqs_per_step)
        self.total_steps = hyper.epochs * self.steps_per_epoch
        warm = max(1, int(hyper.warmup * self.total_steps))
        schedule = optim.join_schedules(
            [
                optim.linear_schedule(hyper.lr * 0.01, hyper.lr, warm),
                optim.cosine_decay(hyper.lr, max(1, self.total_steps - warm), hyper.lr * 0.05),
            ],
            [warm],
        )
        self.opt = optim.AdamW(learning_rate=schedule, weight_decay=hyper.weight_decay)
        self.history = History()
        self._grad = nn.value_and_grad(model, self._loss)

    def _loss(self, b: dict[str, mx.array]) -> mx.array:
        return block_loss(self.model, self.loss_head, b, self.weights, self.hyper.soft)

    def _batch(
        self, seqs: Sequence[TrainSeq], anchors: list[np.ndarray], soft: bool = False
    ) -> dict[str, mx.array]:
        feats = [load_features(self.features_dir, s, self.width, self.hyper.label_k) for s in seqs]
        labels = [self.labels[s.key] for s in seqs]
        return batch_arrays(seqs, feats, labels, anchors, self.model.cfg, soft)

    def label_counts(self) -> list[int]:
        """Valid labels at each draft depth over every training position (anchors >= 1)."""
        total = np.zeros(self.model.cfg.block_size - 1, dtype=np.int64)
        for s in self.train:
            total += label_counts(s.tokens, self.labels[s.key].greedy, self.model.cfg.block_size)
        return total.tolist()

    def _order(self, epoch: int) -> list[TrainSeq]:
        perm = np.random.default_rng([self.hyper.seed, epoch]).permutation(len(self.train))
        return [self.train[i] for i in perm]

    def step(self, step: int) -> float:
        """One optimiser step; the batch and its anchors follow from (seed, step) alone, so a
        resumed run sees the same data it would have seen."""
        epoch, i = divmod(step, self.steps_per_epoch)
        n = self.hyper.seqs_per_step
        seqs = self._order(epoch)[i * n : (i + 1) * n]
        rng = np.random.default_rng([self.hyper.seed, 1, step])
        b = self._batch(seqs, [anchors_for(rng, s, self.hyper) for s in seqs], self.hyper.soft > 0)
        b["labels"] = self.loss_head.labels(b["labels"])
        if "top_ids" in b:
            b["top_ids"] = self.loss_head.labels(b["top_ids"])
        loss, grads = self._grad(b)
        grads, _ = optim.clip_grad_norm(grads, self.hyper.clip)
        self.opt.update(self.model, grads)
        mx.eval(loss, self.model.parameters(), self.opt.state)
        return float(loss)

    def evaluate(self) -> dict:
        """Held-out metrics at every eval_stride-th position. Responses: the loss and tau (greedy
        block drafts accepted up to the first token that differs from the target's label, bonus
        included). Prompt text: text_accept1, the first draft token against the target's
        argmax."""
        if not self.heldout:
            return {}
        losses, acc, text, source = [], [], [], []
        for s in self.heldout:
            prompt = np.arange(1, s.prompt_len, self.hyper.eval_stride)
            resp = np.arange(s.prompt_len, len(s.tokens) - 1, self.hyper.eval_stride)
            if not len(prompt) + len(resp):
                continue
            b = self._batch([s], [np.concatenate([prompt, resp])])
            logits = block_logits(self.model, self.head, b)
            pred, labels = np.array(mx.argmax(logits, axis=-1)), np.array(b["labels"])
            n = len(prompt)
            text.append(pred[:n, 0] == labels[:n, 0])
            if len(resp):
                weight = self.weights[None] * b["valid"][n:]
                losses.append(float(block_objective(logits[n:], b["labels"][n:], weight)))
                acc.append(accepted_lengths(pred[n:], labels[n:], np.array(b["valid"])[n:]))
                source += [s.id.split("-")[0]] * len(resp)
        lengths = np.concatenate(acc) if acc else np.zeros(0)
        depths = range(1, self.model.cfg.block_size) if len(lengths) else ()
        per_pos = [float((lengths >= k).mean()) for k in depths]
        hits = np.concatenate(text) if text else np.zeros(0)
        src = np.array(source, dtype=str)
        return {
            "loss": float(np.mean(losses)) if losses else float("nan"),
            "tau": float(1 + lengths.mean()) if len(lengths) else float("nan"),
            "acceptance_by_position": per_pos,
            "blocks": int(len(lengths)),
            "text_accept1": float(hits.mean()) if len(hits) else float("nan"),
            "text_blocks": int(len(hits)),
            # tau of the response blocks by prompt source (news, code, open: the id's prefix)
            "tau_by_source": {k: float(1 + lengths[src == k].mean()) for k in np.unique(src)},
        }

    def run(self, progress: bool = True) -> History:
        self._resume()
        h = self.history
        if h.step == 0 and not h.evals:
            h.evals.append({"epoch": 0, "step": 0, **self.evaluate()})
        bar = tqdm(total=self.total_steps, initial=h.step, disable=not progress, desc="train")
        while h.step < self.total_steps:
            loss = self.step(h.step)
            if not math.isfinite(loss):
                raise TrainingError(f"loss became {loss} at step {h.step}; lower --lr")
            h.step += 1
            h.loss.append((h.step, loss))
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            if h.step % self.steps_per_epoch == 0:
                h.epoch = h.step // self.steps_per_epoch
                h.evals.append({"epoch": h.epoch, "step": h.step, **self.evaluate()})
                log.info("epoch %d: %s", h.epoch, h.evals[-1])
                self.save_state()
            elif h.step % self.hyper.ckpt_every == 0:
                self.save_state()
        bar.close()
        self.save_state()
        return h

    def _data_id(self) -> str:
        import hashlib

        ids = ",".join(sorted(s.key for s in self.train))
        return (
            f"{len(self.train)} sequences, sha256 {hashlib.sha256(ids.encode()).hexdigest()[:12]}"
        )

    # -- checkpoints -------------------------------------------------------------------------

    def save_state(self) -> None:
        d = self.state_dir
        d.mkdir(parents=True, exist_ok=True)
        params = dict(cast(list, tree_flatten(self.model.parameters())))
        opt = dict(cast(list, tree_flatten(self.opt.state)))
        mx.save_safetensors(str(d / "model.tmp.safetensors"), params)
        mx.save_safetensors(str(d / "optimizer.tmp.safetensors"), opt)
        (d / "state.tmp.json").write_text(
            json.dumps(
                {
                    "hyper": asdict(self.hyper),
                    "data": self._data_id(),
                    "history": asdict(self.history),
                }
            )
        )
        for name in ("model.safetensors", "optimizer.safetensors", "state.json"):
            stem, _, ext = name.partition(".")
            (d / f"{stem}.tmp.{ext}").replace(d / name)  # the JSON last: it marks completeness

    def _resume(self) -> None:
        d = self.state_dir
        if not (d / "state.json").is_file():
            return
        state = json.loads((d / "state.json").read_text())
        # a knob added after the checkpoint was made counts as its default
        saved = {**json.loads(json.dumps(asdict(Hyper()))), **state["hyper"]}
        if saved != json.loads(json.dumps(asdict(self.hyper))):
            raise TrainingError(
                f"checkpoint {str(d)!r} was made with other settings ({state['hyper']}); "
                "accepted: the same settings to resume, or a new --out folder"
            )
        if state.get("data") != self._data_id():
            raise TrainingError(
                f"checkpoint {str(d)!r} was trained on other data ({state.get('data')}, now "
                f"{self._data_id()}); accepted: the same data to resume, or delete {str(d)!r}"
            )
        weights = cast(dict, mx.load(str(d / "model.safetensors")))
        self.model.load_weights(list(weights.items()))
        opt = cast(dict, mx.load(str(d / "optimizer.safetensors")))
        self.opt.state = tree_unflatten(list(opt.items()))
        hist = state["history"]
        self.history = History(
            hist["step"], hist["epoch"], [tuple(x) for x in hist["loss"]], hist["evals"]
        )
        log.info("resumed training at step %d of %d", self.history.step, self.total_steps)
