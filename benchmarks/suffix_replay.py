"""Replay greedy answers against drafters with no model run: at each step the arms are asked in
order (the first non-empty draft is verified against the stored answer, which greedy decoding
makes exact), and tau, acceptance per draft position and a modelled speed-up (a step costs
1 + COST per drafted token, in plain steps) are reported per category.

    python benchmarks/suffix_replay.py --store data/dflash/smollm2-135m \
        --arms "pld:min_ngram=2+suffix+pld" --arms "pld:min_ngram=2+pld" --holdout heldout

--holdout: `heldout` (the store's held-out answers, indexed on the others), `kind:K` (answers
whose id starts with K, indexed on every other kind), `random:N`. --online joins each replayed
answer to the index after it (a server learning its workload). --suite FILE --model M answers
the suite's prompts greedily on the spot (plain mlx-lm) and replays those.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaspec.drafters.arms import plan as drafter_plan  # noqa: E402
from adaspec.drafters.base import DraftContext  # noqa: E402
from adaspec.drafters.spec import validate  # noqa: E402
from adaspec.drafters.suffix import SuffixDrafter  # noqa: E402
from adaspec.drafters.suffix_index import SuffixIndex  # noqa: E402
from adaspec.drafters.suffix_store import Library  # noqa: E402
from adaspec.settings import Settings  # noqa: E402

MAX_DRAFT = 16


def load_store(folder: str):
    from adaspec.train.store import _read_shard

    out = []
    for p in sorted(Path(folder).glob("responses-*.npz")):
        out += _read_shard(p)
    return out


def split(answers, holdout: str, seed: int = 0):
    if holdout == "heldout":
        test = [a for a in answers if a.heldout]
        train = [a for a in answers if not a.heldout]
    elif holdout.startswith("kind:"):
        kind = holdout[5:]
        test = [a for a in answers if a.id.startswith(kind)]
        train = [a for a in answers if not a.id.startswith(kind)]
    elif holdout.startswith("random:"):
        rng = random.Random(seed)
        pick = set(rng.sample(range(len(answers)), int(holdout[7:])))
        test = [a for i, a in enumerate(answers) if i in pick]
        train = [a for i, a in enumerate(answers) if i not in pick]
    else:
        raise SystemExit(f"--holdout {holdout!r}; accepted: heldout, kind:K, random:N")
    return train, test


def build_arms(spec: str, lib: Library):
    """The arms of `spec`; suffix arms search `lib` (their data-file argument is ignored)."""
    from adaspec.drafters.pld import ENTRY as PLD

    out = []
    for arm in (a.spec for a in drafter_plan(spec, None, Settings()).arms):
        if arm.name == "pld":
            out.append(PLD.build(arm, None, Settings()))
        elif arm.name == "suffix":
            from adaspec.drafters.suffix import ENTRY

            o = dict(validate(arm, ENTRY.options, "data file").options)
            for k in ("max_online", "persist"):
                o.pop(k, None)
            out.append(SuffixDrafter(lib, learn=False, **o))
        else:
            raise SystemExit(f"arm {arm} cannot be replayed; accepted: pld, suffix")
    return out


def replay_one(arms, prompt, answer, stats, cost: float):
    arms_state = [a for a in arms]
    ctx0 = DraftContext(list(prompt), 0)
    for a in arms_state:
        a.prefill(list(prompt), ctx0)
    i, n = 0, len(answer)
    while i < n:
        room = min(MAX_DRAFT, n - i - 1)
        draft, used = (), "plain"
        ctx = DraftContext((), room)
        t0 = time.perf_counter()
        for a, name in zip(arms_state, stats["names"]):
            d = a.draft(ctx).tokens if room > 0 else ()
            if d:
                draft, used = d, name
                break
        stats["draft_s"].append(time.perf_counter() - t0)
        acc = 0
        while acc < len(draft) and draft[acc] == answer[i + acc]:
            acc += 1
        for p in range(len(draft)):
            if p <= acc:
                stats["judged"][p] += 1
                stats["accepted"][p] += p < acc
        commit = [int(t) for t in answer[i : i + acc + 1]]
        for a in arms_state:
            a.advance(commit, DraftContext((), 0))
        stats["steps"] += 1
        stats["tokens"] += len(commit)
        stats["cost"] += 1 + cost * len(draft)
        stats["by_arm"][used] += 1
        i += len(commit)


def new_stats(names):
    return {
        "names": names,
        "steps": 0,
        "tokens": 0,
        "cost": 0.0,
        "judged": defaultdict(int),
        "accepted": defaultdict(int),
        "by_arm": defaultdict(int),
        "draft_s": [],
    }


def summary(s) -> dict:
    acc = [round(s["accepted"][p] / s["judged"][p], 3) for p in sorted(s["judged"])][:8]
    return {
        "tau": round(s["tokens"] / max(s["steps"], 1), 3),
        "speedup_model": round(s["tokens"] / max(s["cost"], 1e-9), 3),
        "accept_by_position": acc,
        "steps_by_arm": dict(s["by_arm"]),
        "draft_ms_median": round(statistics.median(s["draft_s"]) * 1e3, 4) if s["draft_s"] else 0,
        "draft_ms_p99": round(float(np.percentile(s["draft_s"], 99)) * 1e3, 4)
        if s["draft_s"]
        else 0,
    }


def suite_answers(path: str, model_name: str, max_tokens: int):
    """Greedy answers to a suite's prompts, generated here with plain decoding."""
    import adaspec
    from adaspec.bench.suite import load_suite

    model, tok = adaspec.load(model_name)
    out = []
    for p in load_suite(path):
        ids = tok.apply_chat_template(p.messages, add_generation_prompt=True)
        got = [
            r.token
            for r in adaspec.stream_generate(
                model, tok, ids, drafter="none", max_tokens=p.max_tokens or max_tokens
            )
        ]
        out.append((p.category, np.array(ids), np.array(got)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="data/dflash/smollm2-135m")
    ap.add_argument("--arms", action="append", required=True)
    ap.add_argument("--holdout", default="heldout")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--cost", type=float, default=0.064)
    ap.add_argument("--online", action="store_true")
    ap.add_argument("--no-index", action="store_true", help="suffix arms search online only")
    ap.add_argument("--suite", default=None)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    answers = load_store(args.store)
    if args.suite:
        train, test = answers, suite_answers(args.suite, args.model, args.max_tokens)
    else:
        train, held = split(answers, args.holdout)
        test = [(a.id.split("-")[0], a.prompt, a.response) for a in held]
    if args.limit:
        test = test[: args.limit]
    t0 = time.perf_counter()
    fixed = None if args.no_index else SuffixIndex.build([a.response for a in train], args.depth)
    build_s = time.perf_counter() - t0
    result = {"build_s": round(build_s, 2), "answers": len(test), "runs": {}}
    for spec in args.arms:
        lib = Library(fixed, args.depth, 1_000_000 if args.online else 0)
        arms = build_arms(spec, lib)
        names = [f"{i}:{a.name}" for i, a in enumerate(arms)]
        total, per_cat = new_stats(names), {}
        for cat, prompt, response in test:
            one = new_stats(names)
            replay_one(arms, prompt, response, one, args.cost)
            for s in (total, per_cat.setdefault(cat, new_stats(names))):
                for k in ("steps", "tokens", "cost"):
                    s[k] += one[k]
                for k in ("judged", "accepted", "by_arm"):
                    for p, v in one[k].items():
                        s[k][p] += v
                s["draft_s"] += one["draft_s"]
            if args.online:
                lib.join(response)
        run = {"all": summary(total), **{c: summary(s) for c, s in sorted(per_cat.items())}}
        result["runs"][spec] = run
        cats = " ".join(f"{c}={v['tau']}" for c, v in run.items())
        print(
            f"{spec}: {cats} | speedup_model {run['all']['speedup_model']} "
            f"acc {run['all']['accept_by_position'][:4]} "
            f"draft_ms med {run['all']['draft_ms_median']} p99 {run['all']['draft_ms_p99']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
