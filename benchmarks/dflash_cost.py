"""DFlash draft cost per block vs one target step on a SmolLM2-135M-shaped target, with the
full draft head and heads restricted to the n most frequent ids; prints the break-even tau
(verify cost ratio + draft/AR + advance/AR) on this machine.

    python benchmarks/dflash_cost.py [--real] [--context 512] [--window 2048] [--reps 30]
        [--layers 1 2 3 5] [--blocks 16 8] [--heads 0 4096 8192 16384] [--weights fp32 bf16]

--weights bf16 adds drafters that read bf16 copies of their own matrices and of a restricted
head's rows (`dflash:DIR,weights=bf16`; a full head is the target's and stays fp32).

--real also measures the real SmolLM2-135M (adaspec.targets.loader.load("smollm2-135m")).

    python benchmarks/dflash_cost.py --coverage [--count-prompts 40] [--heads 4096 8192 16384]
        [--write-set 16384]

--coverage measures what restricted heads give up with the shipped SmolLM2-135M drafter: head
sets from the target's argmax counts over --count-prompts training prompts (the trainer's
split of adaspec/train/corpus_data), then on the held-out prompts' greedy responses, per set
size: how
often the drafter's top-1 and the target's token fall outside the set, and held-out tau (greedy
blocks anchored at every 4th response position). --write-set N writes the N-id set into the
shipped checkpoint.
"""

# isort: off
import adaspec  # noqa: F401  (must come first: loads the fast BLAS before mlx)
import mlx.core as mx

# isort: on
import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from mlx.utils import tree_map

from adaspec.drafters.base import DraftContext
from adaspec.drafters.dflash import DFlashDrafter
from adaspec.drafters.dflash_model import DFlashConfig, DFlashModel
from adaspec.kernels import blas
from adaspec.kernels.shadow import shadow_model
from adaspec.targets.base import embedding_and_head, target_info
from adaspec.targets.kv import KVTarget
from adaspec.train.corpus import SHIPPED_CORPUS

SMOLLM2 = dict(
    hidden_size=576,
    num_hidden_layers=30,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    rms_norm_eps=1e-5,
    vocab_size=49152,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
TAPS = (1, 7, 14, 20, 27)  # z-lab's rule: 5 layers evenly from 1 to L-3
CORPUS = SHIPPED_CORPUS


def random_smollm2():
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", **SMOLLM2))
    mx.eval(model.parameters())
    return model


def interleaved_ms(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, dict[str, float]]:
    """Median and min ms of each fn, run round-robin so load changes hit every one alike
    (docs/benchmarks.md); the min is the least disturbed by other processes on a shared machine."""
    for fn in fns.values():
        for _ in range(2):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {
        stat: {k: 1e3 * f(v) for k, v in times.items()}
        for stat, f in (("median", statistics.median), ("min", min))
    }


def target_steps(model, context: int, sizes: list[int]) -> dict[str, Callable[[], None]]:
    """Verify forwards of n tokens (with the drafter's taps) at `context`, rolled back."""
    rng = np.random.default_rng(0)
    target = KVTarget(model)
    target.prefill(rng.integers(0, 49152, context).tolist())

    def step(n: int) -> Callable[[], None]:
        def run() -> None:
            fwd = target.forward(rng.integers(0, 49152, n).tolist(), TAPS)
            mx.eval(fwd.logits, fwd.features)
            target.rollback(n)

        return run

    return {f"verify {n}": step(n) for n in sizes}


def drafter_steps(
    model, layers: int, block: int, context: int, window: int, heads: list[int], weights: list[str]
) -> dict[str, Callable[[], None]]:
    """Greedy block drafts with the full head (0) and heads restricted to n ids, one advance by
    4 committed tokens (then rolled back), and each head alone over the drafted rows."""
    cfg = DFlashConfig(
        hidden_size=576,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        target_layer_ids=TAPS,
        mask_token_id=0,
        block_size=block,
        num_target_layers=30,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
    )
    mx.random.seed(layers)
    dm = DFlashModel(cfg)
    # which ids are kept does not change the cost, only how many
    dm.head_token_ids = np.random.default_rng(0).permutation(49152)[: max(heads)].astype(np.int32)
    feats = mx.random.normal((context, len(TAPS) * 576))
    prompt = list(range(context + 1))
    ctx = DraftContext(prompt, block - 1)
    h = mx.random.normal((block - 1, 576))
    fns: dict[str, Callable[[], None]] = {}
    for w in weights:
        # bf16: a copy of the weights with shadows (shadowing dm would make fp32 read them too)
        own = dm if w == "fp32" else copy_model(dm)
        shadows = shadow_model(own) if w == "bf16" else None
        for n in heads:
            d = DFlashDrafter(own, target_info(model), window=window, head=n, shadows=shadows)
            d.prefill(prompt, DraftContext(prompt, 0, features=feats))
            fns[f"draft L{layers} B{block} H{n} {w}"] = partial(d.draft, ctx)
            fns[f"head B{block} H{n} {w}"] = partial(d.head.greedy, h)  # logits, argmax, ids

    def advance() -> None:
        d.advance([1, 2, 3, 4], DraftContext(prompt, 0, features=feats[:4]))
        mx.eval(d.cache.keys, d.cache.values)
        d.rollback(4)

    fns[f"advance L{layers}"] = advance
    return fns


def copy_model(dm: DFlashModel) -> DFlashModel:
    """The same weights in arrays of their own."""
    twin = DFlashModel(dm.cfg)
    twin.update(tree_map(lambda a: a + 0, dm.parameters()))
    twin.head_token_ids = dm.head_token_ids
    mx.eval(twin.parameters())
    return twin


def report(name: str, model, args) -> None:
    sizes = sorted({1, 8, 16, *args.blocks})
    fns = target_steps(model, args.context, sizes)
    for layers in args.layers:
        for block in args.blocks:
            fns.update(
                drafter_steps(
                    model, layers, block, args.context, args.window, args.heads, args.weights
                )
            )
    stats = interleaved_ms(fns, args.reps)
    st = blas.status()
    print(
        f"\n## target: {name}, context {args.context}, drafter window {args.window}, fp32, "
        f"BLAS {st.kind if st else '?'}, load {os.getloadavg()[0]:.2f}"
    )
    for stat, t in stats.items():
        ar = t["verify 1"]
        print(
            f"\n{stat} of {args.reps}: "
            + ", ".join(
                f"verify {n} = {t[f'verify {n}']:.1f} ms ({t[f'verify {n}'] / ar:.2f}x)"
                for n in sizes
            )
        )
        print(
            "\n| drafter layers | block | head ids | weights | draft ms (head part) | draft/AR "
            "| advance ms | break-even tau |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for layers in args.layers:
            adv = t[f"advance L{layers}"]
            for block in args.blocks:
                for n in args.heads:
                    for w in args.weights:
                        draft = t[f"draft L{layers} B{block} H{n} {w}"]
                        tau0 = (t[f"verify {block}"] + draft + adv) / ar
                        print(
                            f"| {layers} | {block} | {n or 'all'} | {w} | {draft:.1f} "
                            f"({t[f'head B{block} H{n} {w}']:.1f}) | {draft / ar:.2f} | "
                            f"{adv:.2f} | {tau0:.2f} |"
                        )


def argmax_counts(model, prompts: list[list[int]], vocab: int) -> np.ndarray:
    """How often each id is the target's argmax over the prompts' positions (teacher forced)."""
    counts = np.zeros(vocab, np.int64)
    for ids in prompts:
        logits = KVTarget(model).forward(ids).logits
        counts += np.bincount(np.array(mx.argmax(logits, axis=-1)), minlength=vocab)
    return counts


def heldout_blocks(model, tok, drafter, prompts: list[list[int]], max_new: int):
    """The drafter's hidden states (N, B-1, d) and labels (N, B-1; -1 past the end) of blocks
    anchored at every 4th position of the target's greedy responses, and the response ids."""
    import mlx_lm

    hidden, labels, responses = [], [], []
    k = drafter.block - 1
    for ids in prompts:
        resp = [r.token for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=max_new)]
        tokens, responses = ids + resp, responses + resp
        feats = KVTarget(model).prefill(tokens[:-1], drafter.needs_taps)
        anchors = range(len(ids), len(tokens) - 1, 4)
        last = anchors[-1]
        drafter.prefill(tokens[: last + 1], DraftContext(tokens, 0, features=feats[:last]))
        for a in reversed(anchors):  # rollback is an offset move: walk the anchors backwards
            drafter.rollback(len(drafter.tokens) - (a + 1))
            hidden.append(np.array(drafter.hidden(k)))
            labels.append(np.pad(tokens[a + 1 : a + 1 + k], (0, k), constant_values=-1)[:k])
    return np.stack(hidden), np.stack(labels), np.array(responses)


def greedy_tau(pred: np.ndarray, labels: np.ndarray) -> float:
    """1 + the mean number of leading drafted tokens equal to the target's (bonus included)."""
    ok = (pred == labels) & (labels >= 0)
    return float(1 + np.cumprod(ok, axis=1).sum(axis=1).mean())


def top1(H: np.ndarray, W: np.ndarray, sets: dict[int, np.ndarray]):
    """Argmax of the full head and of each restricted one over hidden states H (N, k, d),
    a few hundred rows of logits at a time."""
    flat = H.reshape(-1, H.shape[-1])
    full = np.zeros(len(flat), np.int64)
    preds = {n: np.zeros(len(flat), np.int64) for n in sets}
    for i in range(0, len(flat), 512):
        logits = flat[i : i + 512] @ W.T
        full[i : i + 512] = logits.argmax(-1)
        for n, S in sets.items():
            preds[n][i : i + 512] = S[logits[:, S].argmax(-1)]
    return full.reshape(H.shape[:2]), {n: p.reshape(H.shape[:2]) for n, p in preds.items()}


def coverage(args) -> None:
    from adaspec.drafters import dflash
    from adaspec.drafters.dflash_checkpoint import write_head_tokens
    from adaspec.drafters.restricted_head import select_head_tokens
    from adaspec.prompting import prompt_ids
    from adaspec.targets.loader import load
    from adaspec.train.corpus import build_prompts

    model, tok = load("smollm2-135m")
    info = target_info(model, tok)
    folder = dflash.default_checkpoint(info)
    drafter = dflash.load(folder, info, head=0)
    built = build_prompts(Path(args.corpus), n_news=285, n_code=229, seed=0)
    ids = [prompt_ids(tok, list(p.messages))[-512:] for p in built]
    train = [i for i, p in zip(ids, built) if not p.heldout]
    picked = np.random.default_rng(0).permutation(len(train))[: args.count_prompts]
    counts = argmax_counts(model, [train[i] for i in picked], info.vocab_size)
    held = [i for i, p in zip(ids, built) if p.heldout][: args.heldout or None]
    H, labels, responses = heldout_blocks(model, tok, drafter, held, 160)
    eos = sorted(tok.eos_token_ids)
    sets = {n: select_head_tokens(counts, n, always=eos) for n in args.heads if n}
    full, preds = top1(H, np.array(embedding_and_head(model)[0].weight), sets)  # tied head
    valid = labels >= 0
    print(
        f"\n## coverage: {len(labels)} held-out blocks of {len(held)} responses, counts from "
        f"{counts.sum()} argmax tokens of {len(picked)} training prompts; full head: tau "
        f"{greedy_tau(full, labels):.3f}\n"
    )
    print("| head ids | drafter top-1 outside | target token outside | held-out tau |")
    print("|---|---|---|---|")
    for n, S in sets.items():
        outside = ~np.isin(np.arange(info.vocab_size), S)
        print(
            f"| {n} | {outside[full][valid].mean():.2%} | {outside[responses].mean():.2%} "
            f"| {greedy_tau(preds[n], labels):.3f} |"
        )
    if args.write_set:
        write_head_tokens(folder, select_head_tokens(counts, args.write_set, always=eos))
        print(f"\nwrote {args.write_set} head ids into {folder}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--window", type=int, default=2048, help="drafter context window (sink 4)")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3, 5])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 8])
    p.add_argument(
        "--heads",
        type=int,
        nargs="+",
        default=[0, 4096, 8192, 16384],
        help="draft head sizes: 0 the full vocabulary, n a head restricted to n token ids",
    )
    p.add_argument("--weights", nargs="+", choices=("fp32", "bf16"), default=["fp32"])
    p.add_argument("--real", action="store_true", help="also the real SmolLM2-135M")
    p.add_argument("--coverage", action="store_true", help="what restricted heads give up")
    p.add_argument("--count-prompts", type=int, default=40)
    p.add_argument("--heldout", type=int, default=0, help="first N held-out prompts (0: all)")
    p.add_argument("--corpus", default=str(CORPUS))
    p.add_argument("--write-set", type=int, default=0, help="with --coverage: store N ids")
    args = p.parse_args()
    if args.coverage:
        coverage(args)
        return
    report("random SmolLM2-135M shape (llama, 30 layers, d=576, V=49152)", random_smollm2(), args)
    if args.real:
        from adaspec.targets.loader import load

        model, _ = load("smollm2-135m")
        report("real SmolLM2-135M-Instruct", model, args)


if __name__ == "__main__":
    main()
