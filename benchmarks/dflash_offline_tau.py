"""A DFlash checkpoint scored by the trainer's held-out evaluation on the dev suite's own
greedy answers: each prompt and the target's 128-token greedy answer become one sequence, and
`Trainer.evaluate` drafts a block at every answer position from teacher-forced tap features
(tau = 1 + leading draft tokens equal to the target's greedy chain). It reads what the training
metrics would read on these prompts, so it tells a gap between held-out and live tau that comes
from the prompts from one that comes from decoding. Untimed.

    python benchmarks/dflash_offline_tau.py [--drafter DIR] [--suite FILE] [--max-tokens 128]
        [--json OUT]

--suite: any JSONL of prompts in the dev suite's format (id, category, messages).
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
from dflash_tau import SUITE, greedy_ar

import adaspec  # noqa: F401  (fast BLAS before mlx)
from adaspec.bench.suite import load_suite
from adaspec.drafters.dflash_checkpoint import load_model
from adaspec.drafters.shipped import CHECKPOINTS as SHIPPED
from adaspec.prompting import prompt_ids
from adaspec.targets.base import target_info
from adaspec.targets.loader import load
from adaspec.train.data import TrainSeq, extract_features
from adaspec.train.recipe import Hyper
from adaspec.train.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default=str(SHIPPED / "smollm2-135m-dflash"))
    ap.add_argument("--suite", default=str(SUITE))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, tok = load(args.model)
    drafter = load_model(args.drafter, target_info(model, tok))
    prompts = load_suite(args.suite)
    seqs = []
    for i, p in enumerate(prompts):
        ids = prompt_ids(tok, p.messages)
        answer = greedy_ar(model, tok, ids, args.max_tokens)
        seqs.append(TrainSeq(f"dev{i}", True, np.array(ids + answer, np.int32), len(ids)))
    hyper = Hyper(eval_stride=1)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        feats = Path(work) / "features"
        extract_features(model, seqs, drafter.cfg.target_layer_ids, feats, hyper.label_k)
        trainer = Trainer(drafter, model, seqs[:1], seqs, feats, Path(work) / "state", hyper)
        for p, s in zip(prompts, seqs):
            trainer.heldout = [s]  # one prompt's answer at a time
            ev = trainer.evaluate()
            rows.append(
                dict(
                    id=p.id,
                    category=p.category,
                    tau=ev["tau"],
                    blocks=ev["blocks"],
                    acceptance_by_position=ev["acceptance_by_position"],
                )
            )
            print(p.id, f"tau {ev['tau']:.3f}", flush=True)
    cats = sorted({r["category"] for r in rows})
    by = {c: statistics.mean(r["tau"] for r in rows if r["category"] == c) for c in cats}
    print("\n| " + " | ".join(cats) + " | all |\n" + "|---" * (len(cats) + 1) + "|")
    mean = statistics.mean(r["tau"] for r in rows)
    print("| " + " | ".join(f"{by[c]:.2f}" for c in cats) + f" | {mean:.2f} |")
    if args.json:
        out = dict(config=vars(args), by_category=by, mean_tau=mean, prompts=rows)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
