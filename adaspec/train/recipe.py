"""What a training run is made of: the data and drafter-shape recipe and the optimisation knobs
(kept free of mlx imports, so the CLI can build its flags from them cheaply)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from .objective import TrainingError


@dataclass(frozen=True)
class Hyper:
    """Optimisation knobs (the drafter's shape lives in its DFlashConfig)."""

    epochs: int = 4
    seqs_per_step: int = 4
    anchors_per_seq: int = 32
    # extra anchors inside the prompt (corpus text, teacher-forced): more blocks per target
    # forward when responses are few; 0 keeps the paper's responses-only recipe
    prompt_anchors: int = 0
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    clip: float = 1.0
    gamma: float = 0.0  # 0: the paper's value for the block size
    seed: int = 0
    eval_stride: int = 4  # held-out anchors: every n-th response position
    ckpt_every: int = 50
    # the training loss's softmax runs over every token ("full") or only over the tokens that
    # occur in the training sequences ("data": a quarter of SmolLM2's vocabulary, ~2x faster
    # steps); held-out evaluation always scores the full vocabulary
    vocab: str = "full"
    # the target's top-k log-probabilities kept per position (soft labels), and the weight of
    # their KL term in the loss: 0 trains on the greedy labels alone, 1 on the soft ones alone
    topk: int = 32
    soft: float = 0.0

    def __post_init__(self) -> None:
        for k in (
            "epochs",
            "seqs_per_step",
            "anchors_per_seq",
            "eval_stride",
            "ckpt_every",
            "topk",
        ):
            if getattr(self, k) < 1:
                raise TrainingError(f"{k}={getattr(self, k)} is invalid; accepted: >= 1")
        if self.vocab not in ("full", "data"):
            raise TrainingError(f"vocab={self.vocab!r} is invalid; accepted: full, data")
        if not 0 <= self.soft <= 1:
            raise TrainingError(f"soft={self.soft} is invalid; accepted: 0 <= soft <= 1")
        if self.prompt_anchors < 0:
            raise TrainingError(f"prompt_anchors={self.prompt_anchors} is invalid; accepted: >= 0")
        if not (self.lr > 0 and 0 <= self.warmup < 1 and self.clip > 0 and self.gamma >= 0):
            raise TrainingError(
                f"lr={self.lr}, warmup={self.warmup}, clip={self.clip}, gamma={self.gamma} "
                "are invalid; accepted: lr > 0, 0 <= warmup < 1, clip > 0, gamma >= 0"
            )

    @property
    def label_k(self) -> int:
        """Top-k log-probabilities the target forward keeps per position: topk with the soft
        term on, else none (the logsumexp and top-k over the vocabulary are ~30% of a
        SmolLM2-135M forward, and hard labels need only the argmax)."""
        return self.topk if self.soft > 0 else 0


@dataclass(frozen=True)
class Recipe:
    """Data and drafter shape; `hyper` holds the optimisation knobs."""

    corpus: str
    n_news: int = 900
    n_code: int = 600
    # short open requests (story, explain, arithmetic, code from a description) seeded by one
    # news sentence or one documented stdlib function
    n_open: int = 0
    # brief requests with no text to copy (story or explanation of a name from the news, a
    # function a stdlib docstring describes, a word problem with two numbers of a news sentence)
    n_brief: int = 0
    # requests about a topic of the news (a noun phrase such as "interest rates"), in six
    # wordings: story, explanation, description, poem, what to know, three facts
    n_topic: int = 0
    # requests the target writes itself (a user turn sampled from the chat template's opening),
    # each answered: general topics, as a chat brings them (adaspec/train/requests.py)
    n_self: int = 0
    heldout: float = 0.05
    max_prompt: int = 512
    max_new: int = 256
    # how many prompts the target answers (news, code, open, brief and topic taking turns);
    # the others train as prompt text alone. None: all of them
    respond: int | None = None
    # the response store (token ids, kept in the repo); None: OUT/work/responses
    data: str | None = None
    # "FIRST-LAST": only the answers in the store's shards FIRST..LAST train (None: every
    # shard); which prompts are answered is still decided by the whole store
    shards: str | None = None
    gen_batch: int = 0  # decoding rows per batch; 0: the small-GEMM kernel's rows (<= 32)
    layers: int = 2
    block: int = 8
    n_taps: int = 5
    mask_token_id: int | None = None  # None: an unused special token of the tokenizer
    # "target": drafter layers start as copies of the target's last ones; "random"; or the
    # folder of a drafter checkpoint of the same shape to go on training (a warm start)
    init: str = "target"
    # draft head: the `head` ids the target predicts most often in the training labels (EOS
    # first), stored in the checkpoint; 0 or >= the vocabulary: the full vocabulary
    head: int = 16384
    hyper: Hyper = field(default_factory=Hyper)

    def __post_init__(self) -> None:
        for k in ("max_prompt", "max_new", "layers", "n_taps"):
            if getattr(self, k) < 1:
                raise TrainingError(f"{k}={getattr(self, k)} is invalid; accepted: >= 1")
        for k in ("gen_batch", "respond", "head"):
            if (getattr(self, k) or 0) < 0:
                raise TrainingError(f"{k}={getattr(self, k)} is invalid; accepted: >= 0")
        counts = (self.n_news, self.n_code, self.n_open, self.n_brief, self.n_topic, self.n_self)
        if min(counts) < 0 or sum(counts) < 2:
            raise TrainingError(
                f"n_news={self.n_news}, n_code={self.n_code}, n_open={self.n_open}, "
                f"n_brief={self.n_brief}, n_topic={self.n_topic}, n_self={self.n_self} are "
                "invalid; accepted: >= 0 each, at least 2 prompts in all"
            )
        if self.block < 2:
            raise TrainingError(f"block={self.block} is invalid; accepted: >= 2")
        if self.shards is not None and self.shard_range is None:
            raise TrainingError(
                f"shards={self.shards!r} is invalid; accepted: FIRST-LAST, two shard numbers "
                "with FIRST <= LAST (e.g. 89-184)"
            )
        if self.warm_start is not None and not (self.warm_start / "config.json").is_file():
            raise TrainingError(
                f"init={self.init!r} is invalid; accepted: target, random, or a DFlash "
                "checkpoint folder (with config.json)"
            )

    @property
    def shard_range(self) -> range | None:
        """The shard numbers `shards` names, or None (every shard, or an invalid value)."""
        m = re.fullmatch(r"(\d+)-(\d+)", self.shards or "")
        if m is None or int(m[1]) > int(m[2]):
            return None
        return range(int(m[1]), int(m[2]) + 1)

    @property
    def warm_start(self) -> Path | None:
        """The checkpoint folder `init` names, or None for "target" / "random"."""
        return None if self.init in ("target", "random") else Path(self.init)


def tiny_recipe(recipe: Recipe) -> Recipe:
    """The --tiny run: a few prompts, short responses, one layer; minutes on a CPU."""
    hyper = replace(recipe.hyper, epochs=3, seqs_per_step=2, anchors_per_seq=8, ckpt_every=5)
    return replace(
        recipe,
        n_news=6,
        n_code=4,
        heldout=0.2,
        max_prompt=96,
        max_new=24,
        gen_batch=4,
        layers=1,
        hyper=hyper,
    )
