"""One rank of a distributed test run (started by mlx.launch, or by the tests with MLX_RANK and
MLX_HOSTFILE set): shards the target, then rank 0 generates every prompt with mlx-lm's AR and
with each drafter, and writes the token ids it got to a JSON file.

Usage: python tests/distributed_worker.py CONFIG.json
CONFIG: {"model": "smollm2-135m" | "tiny" | "tiny:qwen3", "shard": "pipeline" | "tensor",
         "drafters": [...], "prompts": [str | [ids]], "max_tokens": N, "out": PATH,
         "pids": DIR | null,
         "rounds": N (repeat the whole run; large for the tests that kill a rank)}
"""

from __future__ import annotations

# isort: off
import adaspec  # noqa: F401  (first: loads the fast BLAS before mlx)

# isort: on
import json
import os
import sys
from pathlib import Path


def load(name: str):
    if name.startswith("tiny"):  # "tiny" (llama) or "tiny:ARCH"
        from tiny import byte_tokenizer, tiny_model

        arch = name.partition(":")[2] or "llama"
        return tiny_model(arch, seed=0, layers=2), byte_tokenizer()
    from adaspec.cli.common import load_model

    return load_model(name)


def drafter_for(spec: str, model, tokenizer):
    if spec != "draft-model:tiny":
        return spec
    from tiny import tiny_model

    from adaspec.drafters.draft_model import DraftLM
    from adaspec.targets.base import target_info

    # a different random model: drafts are often wrong, so rollback runs every few steps
    return DraftLM(tiny_model("llama", seed=1, layers=1), tokenizer, target_info(model, tokenizer))


def run(cfg: dict, model, tokenizer) -> int:
    from adaspec.api import encode_prompt, stream_generate
    from adaspec.distributed.mirror import mirrored_ar
    from adaspec.distributed.shard import sharding
    from adaspec.distributed.world import world

    w = world()
    out: dict = {"sharding": sharding(model).describe() if sharding(model) else "one process"}
    out["ar"], out["spec"], out["tau"] = [], {d: [] for d in cfg["drafters"]}, {}
    for _ in range(cfg.get("rounds", 1)):
        for p in cfg["prompts"]:
            ids = encode_prompt(tokenizer, p) if isinstance(p, str) else list(p)
            ar = [r.token for r in mirrored_ar(model, tokenizer, ids, cfg["max_tokens"], {})]
            out["ar"].append(ar)
            for d in cfg["drafters"]:
                drafter = drafter_for(d, model, tokenizer)
                got, last = [], None
                for r in stream_generate(
                    model, tokenizer, ids, drafter=drafter, max_tokens=cfg["max_tokens"]
                ):
                    got.append(r.token)
                    last = r
                out["spec"][d].append(got)
                out["tau"].setdefault(d, []).append(last.stats.summary().get("tau", 0))
    out["wire_bytes"] = list(w.wire_bytes()) if w.size > 1 else [0, 0]
    out["collectives"] = w.collectives
    Path(cfg["out"]).write_text(json.dumps(out))
    return 0


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    model, tokenizer = load(cfg["model"])
    from adaspec.distributed import run_ranks
    from adaspec.distributed.world import world

    w = world()
    if cfg.get("pids"):
        Path(cfg["pids"], f"rank{w.rank}.pid").write_text(str(os.getpid()))
    return run_ranks(model, tokenizer, cfg["shard"], lambda: run(cfg, model, tokenizer))


if __name__ == "__main__":
    from adaspec.errors import AdaspecError

    try:
        sys.exit(main())
    except AdaspecError as exc:
        print(f"worker rank error: {exc}", file=sys.stderr)
        sys.exit(3)
