"""Greedy mlx-lm token ids for a prompt suite in this process's ADASPEC_FAST_OPS mode, written as
JSON; run once with `off` and once with `on` and compare (docs/fast_ops.md, "Tests").

    ADASPEC_FAST_OPS=off python benchmarks/fast_ops_identity.py off.json [--suite S] [--tokens 96]
    ADASPEC_FAST_OPS=on python benchmarks/fast_ops_identity.py on.json [--suite S] [--tokens 96]
    python benchmarks/fast_ops_identity.py --compare off.json on.json
"""

import argparse  # noqa: I001  (adaspec must load the BLAS before mlx.core)
import json
import sys

import adaspec  # noqa: F401  (BLAS and the JIT wrapper before mlx)
import mlx.core as mx


def generate(out: str, suite: str | None, tokens: int, model_name: str) -> None:
    from mlx_lm.generate import generate_step

    from adaspec.bench.suite import load_suite
    from adaspec.cli.common import load_model

    model, tok = load_model(model_name)
    ids = {}
    for p in load_suite(suite):
        prompt = mx.array(tok.apply_chat_template(p.messages, add_generation_prompt=True))
        steps = generate_step(prompt, model, max_tokens=tokens)
        ids[p.id] = [int(y) for (y, _), _ in zip(steps, range(tokens))]
    with open(out, "w") as f:
        json.dump(ids, f)


def compare(a: str, b: str) -> int:
    x, y = json.load(open(a)), json.load(open(b))
    same = [k for k in x if x[k] == y.get(k)]
    print(f"{len(same)}/{len(x)} prompts identical, {sum(len(v) for v in x.values())} tokens")
    return 0 if len(same) == len(x) == len(y) else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--compare", action="store_true")
    p.add_argument("--suite", default=None)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--model", default="smollm2-135m")
    a = p.parse_args()
    if a.compare:
        sys.exit(compare(*a.files[:2]))
    generate(a.files[0], a.suite, a.tokens, a.model)


if __name__ == "__main__":
    main()
