"""llama.cpp next to adaspec on the same GGUF and prompts: decode tok/s per prompt and mode, in
one process, the modes taking turns on each prompt (never concurrently: each uses both cores).

    pip install xllamacpp      # or: pip install -e '.[llamacpp]'
    python benchmarks/llamacpp.py [--model smollm2-135m] [--suite JSONL] [--limit N]
        [--category C] [--max-tokens N] [--repeats 3] [--modes M,M,...] [--json OUT]
        [--server PATH] [--drafter SPEC]

Modes: llama (llama.cpp, greedy), llama-ngram-simple and llama-ngram-mod (llama.cpp's own
n-gram speculation at its default settings), mlx-lm (mlx-lm's AR on adaspec's model, the AR
column of `adaspec bench`), adaspec-plain (`--drafter none`), adaspec-auto (the model's default
drafter, or `--drafter SPEC`).

`--server PATH` runs a llama-server binary instead (HTTP on 127.0.0.1, the same flags and
request; the server is started once per mode, again before every ngram-mod run); otherwise
llama.cpp is the `xllamacpp` wheel from PyPI, called in process. Both come from
adaspec/bench/llama_server.py (whose docstring says how to build llama-server for this CPU),
as `adaspec bench --peer llama.cpp` runs them; this script differs in sending the chat
messages (`/v1/chat/completions`: llama.cpp applies the chat template stored in the GGUF)
rather than adaspec's prompt ids, and in its extra modes. Flags, as llama-server spells them:
`-m GGUF -t 2 -tb 2 -ngl 0 -np 1 -c 4096 --jinja --cache-ram 0`, per request temperature 0,
top_k 1, cache_prompt false; the n-gram modes add `--spec-type ngram-simple` (12-token key, up
to 48 drafted) or `ngram-mod` (24-token key, 48-64 drafted), the defaults. Under load
llama.cpp's OpenMP threads wait for each other and its rate collapses far more than
adaspec's: only idle runs compare.

Decode tok/s is counted alike on both sides: the tokens after the first one (which prefill
yields) over the time after it, EOS not counted. llama.cpp reports predicted_n tokens (EOS
included) over predicted_ms, which starts when the first token is sampled. ngram-mod keeps an
n-gram pool across requests, so a repeat would draft from its own earlier answer: its server is
rebuilt before every run (adaspec carries nothing from one generation to the next either).
Texts are compared with adaspec's (mlx-lm's when adaspec does not run); llama.cpp's check of
the prompt is that its prompt token count equals adaspec's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field

from adaspec.bench.llama_server import (
    HttpServer,
    LlamaServer,
    ServerConfig,
    WheelServer,
    check_binary,
)

LLAMA = ("llama", "llama-ngram-simple", "llama-ngram-mod")
MODES = (*LLAMA, "mlx-lm", "adaspec-plain", "adaspec-auto")
SPEC = {"llama-ngram-simple": "ngram-simple", "llama-ngram-mod": "ngram-mod"}
RATIOS = [("adaspec-plain", "llama"), *(("adaspec-auto", m) for m in LLAMA), ("mlx-lm", "llama")]


@dataclass
class Result:
    text: str
    tokens: int
    decode_tok_s: float
    prompt_tokens: int
    drafts: dict = field(default_factory=dict)  # llama.cpp's drafted / accepted counts


def llama_runner(server: LlamaServer, spec: bool):
    """A mode's runner: llama.cpp's chat completion of the messages."""

    def run(messages: list[dict], ids: list[int], max_tokens: int) -> Result:
        c = server.chat(messages, max_tokens)
        drafts = {k: c.drafts.get(k, 0) for k in ("draft_n", "draft_n_accepted")} if spec else {}
        return Result(c.text, c.n, c.decode_tok_s, c.prompt_tokens, drafts)

    return run


def adaspec_runners(
    model_name: str, modes: list[str], drafter: str | None = None
) -> tuple[dict, object]:
    """The mlx-lm / adaspec runners of `modes` on the loaded model, and its tokenizer."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from adaspec import load, stream_generate
    from adaspec.bench.timing import timed
    from adaspec.drafters.arms import default_spec
    from adaspec.targets.base import target_info

    model, tok = load(model_name)
    auto = drafter or default_spec(target_info(model, tok))
    drafters = {"adaspec-plain": "none", "adaspec-auto": auto}

    def wrap(stream_of):
        def run(messages: list[dict], ids: list[int], max_tokens: int) -> Result:
            r = timed(stream_of(ids, max_tokens))
            return Result(tok.decode(r.tokens), len(r.tokens), r.decode_tok_s, len(ids))

        return run

    def ar(ids, n):
        return mlx_lm.stream_generate(model, tok, ids, max_tokens=n, sampler=make_sampler(0.0))

    def spec(drafter):
        return lambda ids, n: stream_generate(model, tok, ids, drafter=drafter, max_tokens=n)

    runners = {"mlx-lm": wrap(ar)} | {m: wrap(spec(d)) for m, d in drafters.items()}
    return {m: runners[m] for m in modes if m in runners}, tok


def bench(args: argparse.Namespace) -> dict:
    from adaspec.bench import load_suite
    from adaspec.cli.bench import select
    from adaspec.prompting import prompt_ids
    from adaspec.settings import get
    from adaspec.targets import catalogue

    modes = [m.strip() for m in args.modes.split(",")]
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--modes {','.join(bad)} unknown; accepted: {','.join(MODES)}")
    gguf = str(catalogue.require(args.model))
    suite = select(load_suite(args.suite), args.category, None, args.limit)
    binary = check_binary(args.server) if args.server else None
    runners, tok = adaspec_runners(args.model, modes, args.drafter)
    servers = {}
    for m in set(modes).intersection(LLAMA):
        cfg = ServerConfig(gguf, args.threads, args.ctx, SPEC.get(m), args.verbose)
        backend = HttpServer(binary, cfg) if binary else WheelServer(cfg)
        servers[m] = LlamaServer(backend, fresh=m == "llama-ngram-mod")
        runners[m] = llama_runner(servers[m], spec=m in SPEC)
    runners = {m: runners[m] for m in modes}
    prompts = [(p, prompt_ids(tok, p.messages), args.max_tokens or p.max_tokens) for p in suite]
    for run in runners.values():  # warm-up
        run(prompts[0][0].messages, prompts[0][1], 16)
    records = []
    for p, ids, n in prompts:
        runs: dict[str, list[Result]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for m, run in runners.items():
                runs[m].append(run(p.messages, ids, n))
        records.append(record(p, ids, runs))
        print(row(records[-1], modes), flush=True)
    keys = ("model", "threads", "ctx", "repeats", "max_tokens", "drafter")
    config = {k: getattr(args, k) for k in keys}
    config |= {"gguf": gguf, "suite": args.suite or "adaspec/bench/prompts.jsonl"}
    info = next((s.backend.build() for s in servers.values()), "")
    if args.server:
        config |= {"llama_server": args.server, "llama_system_info": info}
    else:
        import xllamacpp as xl

        config |= {"xllamacpp": xl.__version__, "llama_system_info": info}
    for server in servers.values():
        server.close()
    config["stored_weights"] = get().stored_weights
    return {"config": config, "records": records, "summary": summary(records, modes)}


def record(p, ids: list[int], runs: dict[str, list[Result]]) -> dict:
    """One prompt's medians, ratios and whether each mode's text equals the reference's."""
    tps = {m: round(statistics.median(r.decode_tok_s for r in rs), 2) for m, rs in runs.items()}
    first = {m: rs[0] for m, rs in runs.items()}
    ref = next((m for m in ("adaspec-plain", "adaspec-auto", "mlx-lm") if m in first), None)
    rec = {"id": p.id, "category": p.category, "prompt_tokens": len(ids), "tok_s": tps}
    rec["ratios"] = {
        f"{a}/{b}": round(tps[a] / tps[b], 4) for a, b in RATIOS if tps.get(a) and tps.get(b)
    }
    if ref:
        rec["reference"] = ref
        rec["same_text"] = {m: r.text.strip() == first[ref].text.strip() for m, r in first.items()}
    if "llama" in first:  # llama.cpp's speculation against its own plain output
        plain = first["llama"].text.strip()
        rec["same_as_llama"] = {m: first[m].text.strip() == plain for m in SPEC if m in first}
    rec["tokens"] = {m: r.tokens for m, r in first.items()}
    rec["prompt_match"] = {m: r.prompt_tokens == len(ids) for m, r in first.items()}
    rec["drafts"] = {m: r.drafts for m, r in first.items() if r.drafts}
    rec["texts"] = {m: r.text for m, r in first.items()}
    return rec


def summary(records: list[dict], modes: list[str]) -> dict:
    med = statistics.median
    out = {"median_tok_s": {m: round(med(r["tok_s"][m] for r in records), 2) for m in modes}}
    keys = dict.fromkeys(k for r in records for k in r["ratios"])  # a 0 tok/s run has none
    out["median_ratios"] = {
        k: round(med(r["ratios"][k] for r in records if k in r["ratios"]), 4) for k in keys
    }
    if "same_text" in records[0]:
        out["same_text"] = {m: sum(r["same_text"][m] for r in records) for m in modes}
    out["prompt_match"] = {m: sum(r["prompt_match"][m] for r in records) for m in modes}
    for m in records[0].get("same_as_llama", {}):
        out.setdefault("same_as_llama", {})[m] = sum(r["same_as_llama"][m] for r in records)
    for m in records[0]["drafts"]:
        n, a = (sum(r["drafts"][m][k] for r in records) for k in ("draft_n", "draft_n_accepted"))
        out.setdefault("drafts", {})[m] = {"draft_n": n, "draft_n_accepted": a}
    out["prompts"] = len(records)
    return out


def row(rec: dict, modes: list[str]) -> str:
    tps = " ".join(f"{m}={rec['tok_s'][m]:.1f}" for m in modes)
    ratios = " ".join(f"{k}={v:.2f}" for k, v in rec["ratios"].items())
    diff = [m for m, same in rec.get("same_text", {}).items() if not same]
    return f"{rec['id']:16s} {tps} | {ratios} | text differs: {','.join(diff) or 'none'}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="catalogue name (its GGUF for both)")
    p.add_argument("--suite", default=None, help="prompt JSONL (default: adaspec's shipped suite)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--category", action="append", default=[], help="only these (a,b or repeat)")
    p.add_argument("--max-tokens", type=int, default=None, help="override each prompt's")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and mode")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of these")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=4096, help="llama.cpp's context size")
    p.add_argument("--verbose", action="store_true", help="llama.cpp's own log on stderr")
    p.add_argument("--server", default=None, help="a llama-server binary (else the wheel)")
    p.add_argument("--drafter", default=None, help="adaspec-auto's spec (default: the model's)")
    p.add_argument("--json", default=None, help="write config, records and summary here")
    a = p.parse_args()
    res = bench(a)
    s = res["summary"]
    build = res["config"].get("xllamacpp") or res["config"].get("llama_server")
    print(f"\nllama.cpp {build}: {res['config']['llama_system_info']}")
    print(f"median decode tok/s over {s['prompts']} prompts:")
    for m, v in s["median_tok_s"].items():
        same, ok = s.get("same_text", {}).get(m, "-"), s["prompt_match"][m]
        print(f"  {m:20s} {v:8.2f}  same text {same}/{s['prompts']}  same prompt length {ok}")
    for k, v in s["median_ratios"].items():
        print(f"  {k:36s} {v:.3f}x (median of per-prompt ratios)")
    for m, d in s.get("drafts", {}).items():
        same = s.get("same_as_llama", {}).get(m, "-")
        print(f"  {m}: {d['draft_n_accepted']} of {d['draft_n']} drafted tokens accepted, ", end="")
        print(f"same text as llama.cpp plain {same}/{s['prompts']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
