"""DFlash draft cost per block vs one target step on a SmolLM2-135M-shaped target; prints the
break-even tau on this machine.

    python benchmarks/dflash_cost.py [--real] [--context 512] [--window 2048] [--reps 30]

--real also measures the real SmolLM2-135M (adaspec.targets.loader.load("smollm2-135m")).
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

import numpy as np

from adaspec.drafters.base import DraftContext
from adaspec.drafters.dflash import DFlashDrafter
from adaspec.drafters.dflash_model import DFlashConfig, DFlashModel
from adaspec.kernels import blas
from adaspec.targets.adapter import KVTarget, target_info

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


def random_smollm2():
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", **SMOLLM2))
    mx.eval(model.parameters())
    return model


def interleaved_ms(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, dict[str, float]]:
    """Median and min ms of each fn, run round-robin so load changes hit every one alike
    (DESIGN §8); the min is the least disturbed by other processes on a shared machine."""
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


def target_steps(model, context: int) -> dict[str, Callable[[], None]]:
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

    return {f"verify {n}": step(n) for n in (1, 8, 16)}


def drafter_steps(
    model, layers: int, block: int, context: int, window: int
) -> dict[str, Callable[[], None]]:
    """One greedy block draft, and one advance by 4 committed tokens (then rolled back)."""
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
    d = DFlashDrafter(DFlashModel(cfg), target_info(model), window=window)
    feats = mx.random.normal((context, len(TAPS) * 576))
    prompt = list(range(context + 1))
    d.prefill(prompt, DraftContext(prompt, 0, features=feats))
    ctx = DraftContext(prompt, block - 1)

    def advance() -> None:
        d.advance([1, 2, 3, 4], DraftContext(prompt, 0, features=feats[:4]))
        mx.eval(d.cache.keys, d.cache.values)
        d.rollback(4)

    h = mx.random.normal((block - 1, 576))

    def head() -> None:  # the target's tied lm_head over the drafted rows, a floor of the cost
        mx.argmax(d._head(h), axis=-1).tolist()

    return {
        f"draft L{layers} B{block}": lambda: d.draft(ctx),
        f"advance L{layers}": advance,
        f"head B{block}": head,
    }


def report(name: str, model, args) -> None:
    fns = target_steps(model, args.context)
    for layers in args.layers:
        for block in (16, 8):
            fns.update(drafter_steps(model, layers, block, args.context, args.window))
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
                for n in (1, 8, 16)
            )
        )
        print(
            "\n| drafter layers | block | draft ms (lm_head part) | draft/AR | advance ms "
            "| break-even tau |"
        )
        print("|---|---|---|---|---|---|")
        for layers in args.layers:
            adv = t[f"advance L{layers}"]
            for block in (16, 8):
                draft = t[f"draft L{layers} B{block}"]
                tau0 = (t[f"verify {block}"] + draft + adv) / ar
                print(
                    f"| {layers} | {block} | {draft:.1f} ({t[f'head B{block}']:.1f}) "
                    f"| {draft / ar:.2f} | {adv:.2f} | {tau0:.2f} |"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--window", type=int, default=2048, help="drafter context window (sink 4)")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3, 5])
    p.add_argument("--real", action="store_true", help="also the real SmolLM2-135M")
    args = p.parse_args()
    report("random SmolLM2-135M shape (llama, 30 layers, d=576, V=49152)", random_smollm2(), args)
    if args.real:
        from adaspec.targets.loader import load

        model, _ = load("smollm2-135m")
        report("real SmolLM2-135M-Instruct", model, args)


if __name__ == "__main__":
    main()
