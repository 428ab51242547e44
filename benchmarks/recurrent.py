"""Recurrent targets on this machine, with random weights at about SmolLM2-135M's size:

    python benchmarks/recurrent.py rollback [--arch qwen3_5 ...] [--context 512] [--reps 15]
        cost of one rollback per strategy (restore + replay of m accepted tokens, evaluated)
        next to one plain target step and the verify forward it follows, interleaved
    python benchmarks/recurrent.py make DIR [--arch qwen3_5]
        write an mlx-lm folder (random weights + SmolLM2's tokenizer) for `adaspec bench`
    python benchmarks/recurrent.py accept [--arch qwen3_5] [--draft 5] [--tokens 96]
        decode speed vs mlx-lm AR when a drafter gets exactly `a` of `draft` tokens accepted
        per step (drafts copied from AR's own output, wrong from position a on), per strategy

Random weights: the text is meaningless, so acceptance rates say nothing about real models;
the costs do (they depend on shapes only).
"""

# isort: off
import adaspec  # noqa: F401  (must come first: loads the fast BLAS before mlx)
import mlx.core as mx

# isort: on
import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

from adaspec.kernels import blas
from adaspec.targets.architectures import available
from adaspec.targets.replay import ReplayTarget

VOCAB = 49152  # SmolLM2's tokenizer
_QWEN_LINEAR = dict(
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
)
_QWEN = dict(
    hidden_size=576,
    num_hidden_layers=28,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=8192,
    full_attention_interval=4,  # 3 Gated-DeltaNet layers per attention layer, as in Qwen3.5
    tie_word_embeddings=True,
    **_QWEN_LINEAR,
)
CONFIGS = {
    "qwen3_5": dict(
        model_type="qwen3_5",
        text_config=dict(
            model_type="qwen3_5_text",
            rope_parameters={
                "type": "default",
                "mrope_section": [3, 3, 2],
                "rope_theta": 100000.0,
                "partial_rotary_factor": 0.25,
            },
            **_QWEN,
        ),
    ),
    "qwen3_next": dict(
        model_type="qwen3_next",
        rope_theta=100000.0,
        partial_rotary_factor=0.25,
        num_experts=0,  # dense MLPs: same cost per token as SmolLM2's
        num_experts_per_tok=0,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
        moe_intermediate_size=0,
        mlp_only_layers=[],
        **_QWEN,
    ),
    "mamba2": dict(  # mamba2-130m's shape with SmolLM2's vocabulary
        model_type="mamba2",
        num_heads=24,
        head_dim=64,
        vocab_size=VOCAB,
        hidden_size=768,
        intermediate_size=1536,
        state_size=128,
        num_hidden_layers=24,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        time_step_limit=[0.001, 100.0],
        time_step_rank="auto",
    ),
}


def build(arch: str):
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(CONFIGS[arch]))
    mx.eval(model.parameters())
    return model


def n_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def _smollm2_dir() -> Path:
    from adaspec.targets.loader import resolve

    return Path(resolve("smollm2-135m")[0])


def smollm2_tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(_smollm2_dir())


def make_folder(arch: str, out: Path) -> None:
    smol = _smollm2_dir()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(smol) / name, out / name)
    model = build(arch)
    cfg = {**CONFIGS[arch], "eos_token_id": [0, 2], "bos_token_id": 1}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    print(f"{out}: random-weight {arch}, {n_params(model) / 1e6:.1f}M parameters")


def _eval_cache(target) -> None:
    mx.eval([c.state for c in target.cache])


def rollback_costs(arch: str, context: int, draft: int, reps: int) -> dict:
    """ms (median and min per key): one plain step, the verify forward of draft+1 tokens
    (recording included), and the rollback that keeps m of them, per strategy; rounds
    interleave everything. The min is the least disturbed by other processes."""
    model = build(arch)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, context).tolist()
    strategies = available(ReplayTarget(model))
    targets = {s: ReplayTarget(model, strategy=s) for s in strategies}
    for t in targets.values():
        t.prefill(prompt)
    keeps = (1, (draft + 1) // 2, draft)
    times: dict[str, list[float]] = {}

    @contextmanager
    def clock(key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        times.setdefault(key, []).append(1e3 * (time.perf_counter() - t0))

    for rnd in range(reps + 2):  # the first two rounds warm up (compiles) and are dropped
        for s, t in targets.items():
            step = rng.integers(0, VOCAB, 1).tolist()
            with clock(f"{s} step 1"):
                mx.eval(t.forward(step).logits)
                _eval_cache(t)
            t.rollback(1)
            for m in keeps:
                toks = rng.integers(0, VOCAB, draft + 1).tolist()
                with clock(f"{s} verify {draft + 1}"):
                    mx.eval(t.forward(toks).logits)
                _eval_cache(t)
                with clock(f"{s} rollback keep {m}"):
                    t.rollback(draft + 1 - m)
                    _eval_cache(t)
                t.rollback(m)  # back to the prompt (within the same forward: cheap)
        if rnd == 1:
            times.clear()
    return {
        stat: {k: f(v) for k, v in times.items()}
        for stat, f in (("median", statistics.median), ("min", min))
    } | {
        "params_m": n_params(model) / 1e6,
        "strategies": strategies,
        "keeps": keeps,
    }


def report_rollback(arch: str, args: argparse.Namespace) -> None:
    r = rollback_costs(arch, args.context, args.draft, args.reps)
    st = blas.status()
    print(
        f"\n### {arch}, random weights, {r['params_m']:.0f}M params, context {args.context}, "
        f"draft {args.draft}, fp32, BLAS {st.kind if st else '?'}, load {os.getloadavg()[0]:.2f}"
    )
    head = [f"keep {m}" for m in r["keeps"]]
    for stat in ("min", "median"):
        t = r[stat]
        step = statistics.median([t[f"{s} step 1"] for s in r["strategies"]])
        print(f"\n{stat} of {args.reps}: one plain step {step:.1f} ms\n")
        print(f"| strategy | verify {args.draft + 1} | " + " | ".join(head) + " |")
        print("|---|---|" + "---|" * len(head))
        for s in r["strategies"]:
            verify = t[f"{s} verify {args.draft + 1}"]
            cells = [_cost(t[f"{s} rollback keep {m}"], step) for m in r["keeps"]]
            print(f"| {s} | {_cost(verify, step)} | " + " | ".join(cells) + " |")


def _cost(ms: float, step: float) -> str:
    return f"{ms:.1f} ms = {ms / step:.2f} steps"


class ControlledDrafter:
    """Proposes the AR continuation with its token at position `accept` altered, so every
    verify accepts exactly `accept` tokens (the gate is off: every step speculates)."""

    name = "controlled"
    needs_taps: tuple[int, ...] = ()
    vocab_size = None

    def __init__(self, reference: list[int], n_prompt: int, draft: int, accept: int):
        self.reference, self.n_prompt, self.k, self.accept = reference, n_prompt, draft, accept
        self.done = 0

    def prefill(self, prompt_tokens, ctx) -> None:
        self.done = 0

    def draft(self, ctx):
        from adaspec.drafters.base import Draft

        toks = list(self.reference[self.done : self.done + min(self.k, ctx.max_draft)])
        if self.accept < len(toks):
            toks[self.accept] = (toks[self.accept] + 1) % VOCAB
        return Draft(tuple(toks))

    def advance(self, committed_tokens, ctx) -> None:
        self.done += len(committed_tokens)

    def rollback(self, n: int) -> None:
        self.done -= n


def accept_speed(arch: str, draft: int, n_tokens: int, reps: int) -> None:
    """Decode-rate ratio to mlx-lm AR at controlled acceptance, per rollback strategy."""
    import mlx_lm

    from adaspec.api import stream_generate
    from adaspec.bench.timing import timed
    from adaspec.loop.controller import AlwaysSpeculate
    from adaspec.settings import from_env

    model, tok = build(arch), smollm2_tokenizer()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, 256).tolist()
    ref = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=n_tokens)]
    strategies = available(ReplayTarget(model))
    print(f"\n### {arch}: decode speed vs AR at exactly `a` of {draft} drafted tokens accepted")
    load = os.getloadavg()[0]
    print(f"{n_tokens} tokens after a 256-token prompt, median of {reps}, load {load:.2f}\n")
    print("| a (tau = a+1) | " + " | ".join(strategies) + " |")
    print("|---|" + "---|" * len(strategies))
    for a in (0, 1, 3, draft):
        ratios: dict[str, list[float]] = {s: [] for s in strategies}
        for _ in range(reps):
            for s in strategies:  # AR, strategy, AR, strategy, ... interleaved
                ar = timed(mlx_lm.stream_generate(model, tok, prompt, max_tokens=n_tokens))
                spec = timed(
                    stream_generate(
                        model,
                        tok,
                        prompt,
                        drafter=ControlledDrafter(ref, len(prompt), draft, a),
                        max_tokens=n_tokens,
                        policy=AlwaysSpeculate(),
                        settings=from_env({}, rollback=s),
                    )
                )
                assert spec.tokens == ar.tokens == ref, "output differs from AR"
                ratios[s].append(spec.decode_tok_s / ar.decode_tok_s)
        cells = [f"{statistics.median(ratios[s]):.2f}x" for s in strategies]
        print(f"| {a} ({a + 1}) | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    rb = sub.add_parser("rollback")
    rb.add_argument("--arch", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    rb.add_argument("--context", type=int, default=512)
    rb.add_argument("--draft", type=int, default=5)
    rb.add_argument("--reps", type=int, default=15)
    ac = sub.add_parser("accept")
    ac.add_argument("--arch", default="qwen3_5", choices=list(CONFIGS))
    ac.add_argument("--draft", type=int, default=5)
    ac.add_argument("--tokens", type=int, default=96)
    ac.add_argument("--reps", type=int, default=3)
    mk = sub.add_parser("make")
    mk.add_argument("dir", type=Path)
    mk.add_argument("--arch", default="qwen3_5", choices=list(CONFIGS))
    args = ap.parse_args()
    if args.cmd == "make":
        make_folder(args.arch, args.dir)
        return
    if args.cmd == "accept":
        accept_speed(args.arch, args.draft, args.tokens, args.reps)
        return
    for arch in args.arch:
        report_rollback(arch, args)


if __name__ == "__main__":
    main()
