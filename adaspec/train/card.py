"""The model card (README.md) and the loss / tau curves (curves.png, needs matplotlib) of a
trained drafter, both made from metrics.json alone."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def _smooth(values: list[float], n: int = 20) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    if len(v) < n:
        return v
    return np.convolve(v, np.ones(n) / n, mode="valid")


def eval_table(evals: list[dict]) -> str:
    rows = [
        "| epoch | step | held-out loss | held-out tau | accept@1 | accept@3 |",
        "|---|---|---|---|---|---|",
    ]
    for e in evals:
        acc = e.get("acceptance_by_position") or [float("nan")] * 3
        rows.append(
            f"| {e['epoch']} | {e['step']} | {e.get('loss', float('nan')):.3f} | "
            f"{e.get('tau', float('nan')):.2f} | {acc[0]:.2f} | {acc[min(2, len(acc) - 1)]:.2f} |"
        )
    return "\n".join(rows)


def runs(m: dict) -> list[dict]:
    """The runs behind a drafter, oldest first: a warm start carries its predecessor's metrics."""
    chain = []
    while m:
        chain.append(m)
        m = m.get("warm_start") or {}
    return chain[::-1]


_INIT = {
    "target": "each drafter layer starts as a copy of one of the target's last layers, the "
    "final norm as the target's",
    "random": "random",
}


def _warm_start(m: dict, level: int = 0) -> str:
    """The runs this one continued, newest first (each warm start carries its predecessor)."""
    prev = m.get("warm_start")
    if not prev:
        return ""
    ph, pd = prev["recipe"]["hyper"], prev["data"]
    seqs, resp = pd.get("train_sequences", "?"), pd.get("train_response_tokens", "?")
    block = prev.get("drafter", {}).get("dflash_config", {}).get("block_size", "?")
    heading, who = ("## Warm start", "This run") if level == 0 else ("### Before that", "That run")
    return f"""
{heading}
{who} started from the weights of a run of {prev["steps"]} steps
({ph["epochs"]} epochs, block {block}, lr {ph["lr"]}, softmax over the {ph.get("vocab", "full")}
vocabulary) on its own data ({seqs} training sequences, {resp} response tokens). Its held-out
evaluation, on its own held-out sequences:

{eval_table(prev["evals"])}
{_warm_start(prev, level + 1)}"""


def _head(m: dict) -> str:
    n = m.get("head_tokens", 0)
    if not n:
        return ""
    labels = m["data"].get("train_first_labels")
    labels = f"{labels:,}" if isinstance(labels, int) else "?"
    return f"""
## Draft head
The drafter proposes from {n:,} token ids (`head_token_ids` in model.safetensors, int32): the
end-of-text ids, then the ids the target predicted most often over the training sequences'
{labels} first-position labels. A drafted id outside the set cannot be proposed; the target
still verifies every token, so the output is unchanged. `dflash:DIR,head=0` uses the full head.
"""


def prompt_counts(r: dict) -> str:
    """The prompts a recipe built, by source (brief and topic requests only when there are
    some)."""
    parts = [f"{r['n_news']} news prompts", f"{r['n_code']} code prompts"]
    parts.append(f"{r.get('n_open', 0)} short open requests")
    if r.get("n_brief"):
        parts.append(f"{r['n_brief']} brief requests")
    if r.get("n_topic"):
        parts.append(f"{r['n_topic']} topic requests")
    if r.get("n_self"):
        parts.append(f"{r['n_self']} requests written by the target")
    return ", ".join(parts)


def write(out: Path, m: dict) -> None:
    r, h, d = m["recipe"], m["recipe"]["hyper"], m["data"]
    cfg = m["drafter"]
    dc = cfg["dflash_config"]
    vocab = "tokens of the training data" if h.get("vocab") == "data" else "full vocabulary"
    store = f"`{d.get('store', '')}`" + (f" (shards {r['shards']})" if r.get("shards") else "")
    # a warm start's record says what its path held when this run began; the path may not
    if m.get("warm_start"):
        init = 'a warm start from the weights of the run under "Warm start" below'
    else:
        init = _INIT.get(r["init"], f"a warm start from the drafter at `{r['init']}`")
    text = f"""# DFlash drafter ({cfg["num_hidden_layers"]} layers, block {dc["block_size"]})

A block-diffusion drafter for adaspec in z-lab's checkpoint format, trained by
`adaspec train-dflash` against a frozen target by self-distillation.

- Target layers tapped: {dc["target_layer_ids"]} of {cfg["num_target_layers"]}
- Hidden {cfg["hidden_size"]}, {cfg["num_attention_heads"]} heads / {cfg["num_key_value_heads"]} kv
  heads, head_dim {cfg["head_dim"]}, intermediate {cfg["intermediate_size"]}
- Mask token id {dc["mask_token_id"]}: {m["mask_token"]["why"]}.
- Initialisation: {init}.

## Data
Prompts built from the corpus at `{r["corpus"]}` only: {prompt_counts(r)} (instruction
templates in `adaspec/train/corpus.py`, seed {h["seed"]}),
{r["heldout"]:.0%} held out by a hash of the source text, cut to their last {r["max_prompt"]}
tokens. The target answered {d.get("answered_train_sequences", "all")} of the training prompts
(greedy, up to {r["max_new"]} tokens; the answers are kept as token ids in {store});
the others train as prompt text alone. {d["train_sequences"]} training sequences
({d.get("train_prompt_tokens", "?")} prompt and {d["train_response_tokens"]} response tokens),
{d["heldout_sequences"]} held out.

Labels come from one forward of the target over each sequence, never from the text itself: draft
position j of a block anchored at a is labelled with the target's argmax after token a+j-1, and
scored only while tokens a+1..a+j-1 are the target's own greedy chain. Valid labels by draft
position over all training positions: {d.get("labels_by_depth", "not counted")}.

## Training
{m["steps"]} steps: {h["epochs"]} epochs of {h["seqs_per_step"]} sequences x
{h["anchors_per_seq"]} random anchors in each response (plus {h.get("prompt_anchors", 0)} in
each prompt; a sequence without a response takes all of them in its prompt) per step; block
loss with position weights exp(-(k-1)/gamma) (gamma {h["gamma"] or "the paper default"}):
{1 - h.get("soft", 0.0):.2f} x cross entropy against the greedy labels +
{h.get("soft", 0.0):.2f} x KL from the target's top-{h.get("topk", 32)} distribution, softmax over
the {vocab}; AdamW lr {h["lr"]}, weight decay {h["weight_decay"]}, warm-up {h["warmup"]:.0%}
then cosine, gradient clip {h["clip"]}.
Final training loss (mean of the last 20 steps): {m["final_train_loss"]:.3f}.

## Held-out evaluation
tau = 1 + the number of leading draft tokens equal to the target's greedy labels (what greedy
verification accepts, bonus token included), over blocks anchored at every
{h["eval_stride"]}th response position of the held-out sequences; text accept@1 (the first draft
token against the target's argmax at every {h["eval_stride"]}th prompt position) in
metrics.json.

{eval_table(m["evals"])}
{_head(m)}{_warm_start(m)}"""
    (out / "README.md").write_text(text)
    plot(out / "curves.png", m)


def plot(path: Path, m: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed (pip install 'adaspec[plot]'): no %s", path.name)
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    offset = 0
    for i, run in enumerate(runs(m)):  # a warm start's runs one after the other
        steps = [offset + s for s, _ in run["loss"]]
        loss = _smooth([v for _, v in run["loss"]])
        a.plot(steps[len(steps) - len(loss) :], loss, label=f"run {i + 1}")
        ev = [e for e in run["evals"] if "tau" in e]
        b.plot([offset + e["step"] for e in ev], [e["tau"] for e in ev], marker="o")
        offset += run["steps"]
    a.set(xlabel="step", ylabel="training loss (20-step mean)", title="loss")
    if offset > m["steps"]:  # more than one run: say which curve is which
        a.legend()
    b.set(xlabel="step", ylabel="held-out tau", title="tau (greedy, bonus included)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
