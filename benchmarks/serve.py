"""`adaspec serve` against `mlx_lm.server` on one machine: a 4-turn chat (time to first token and
decode tok/s per turn, each turn sent to every server in turn, same requests), then, at each
level of --concurrent, N clients sending held-out chat requests (benchmarks/prompts/dev.jsonl)
at once: aggregate tok/s, per-request decode tok/s, time to first token p50/p95, and whether
every text equals the other server's. mlx_lm.server runs with the BLAS `import adaspec` loads.

    python benchmarks/serve.py --model smollm2-135m --concurrent 1,2,4,8 --skip-chat
    python benchmarks/serve.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_serve import start  # noqa: E402  (the tests' bounded server start)

MLX_LM = "import adaspec; from mlx_lm.server import main; main()"
TURNS = [
    "Write a Python function `merge_counts(a, b)` that merges two dicts of counts.",
    "Add a docstring and type hints to the function, and return the whole function.",
    "Now rename it to `combine_counts` and show the whole function again.",
    "Write three pytest tests for it.",
]


def stream_chat(port: int, messages: list, max_tokens: int) -> dict:
    import openai

    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=600)
    t0 = time.perf_counter()
    first = last = None
    text, usage = "", {}
    for ch in c.chat.completions.create(
        model="default_model", messages=messages, max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True},
    ):  # fmt: skip
        if ch.choices and ch.choices[0].delta.content:
            first = first or time.perf_counter()
            last = time.perf_counter()
            text += ch.choices[0].delta.content
        if ch.usage:
            usage = ch.usage.model_dump()
    n = usage.get("completion_tokens", 0)
    return {
        "ttft_s": (first or last or t0) - t0,
        "decode_tps": (n - 1) / (last - first) if first and last and last > first else 0.0,
        "tokens": n,
        "text": text,
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "adaspec": usage.get("adaspec"),
    }


def chat_run(ports: dict, max_tokens: int) -> dict:
    """Every turn to every server; the next turn's history uses the first server's reply."""
    messages: list = []
    out: dict = {name: [] for name in ports}
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        replies = {name: stream_chat(port, messages, max_tokens) for name, port in ports.items()}
        for name, r in replies.items():
            out[name].append(r)
        ref = next(iter(replies.values()))["text"]
        out["same_text"] = out.get("same_text", []) + [
            all(r["text"] == ref for r in replies.values())
        ]
        messages.append({"role": "assistant", "content": ref})
    return out


def held_out(n: int) -> list[list[dict]]:
    """The first n chat requests of the dev suite (cycled)."""
    path = Path(__file__).resolve().parent / "prompts" / "dev.jsonl"
    rows = [json.loads(line)["messages"] for line in path.read_text().splitlines() if line]
    return [rows[i % len(rows)] for i in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else 0.0


def concurrent_run(port: int, n: int, max_tokens: int, per_client: int) -> dict:
    """n clients, each sending its share of n * per_client held-out requests one after another."""
    asks = held_out(n * per_client)

    def client(c: int) -> list[dict]:
        return [stream_chat(port, asks[i], max_tokens) for i in range(c, len(asks), n)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        done = [r for rs in pool.map(client, range(n)) for r in rs]
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in done)
    return {
        "clients": n,
        "requests": len(done),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "aggregate_tps": round(tokens / wall, 2),
        "decode_tps_p50": _pct([r["decode_tps"] for r in done], 0.5),
        "ttft_p50_s": _pct([r["ttft_s"] for r in done], 0.5),
        "ttft_p95_s": _pct([r["ttft_s"] for r in done], 0.95),
        "batch_size_mean": round(
            sum((r["adaspec"] or {}).get("batch_size", 1.0) for r in done) / len(done), 2
        ),
        "texts": [r["text"] for r in done],  # request order: the same on every server
    }


def summary(turns: list[dict]) -> dict:
    toks = sum(t["tokens"] for t in turns)
    decode_s = sum((t["tokens"] - 1) / t["decode_tps"] for t in turns if t["decode_tps"])
    return {
        "ttft_s": [round(t["ttft_s"], 3) for t in turns],
        "decode_tps_over_chat": round((toks - len(turns)) / decode_s, 2) if decode_s else 0.0,
    }


def merge(a: dict, b: dict) -> dict:
    for k, v in b.items():
        a[k] = {**a.get(k, {}), **v} if isinstance(v, dict) else a.get(k, []) + v
    return a


def run_servers(servers: dict, a: argparse.Namespace) -> dict:
    """Start `servers`, run the chat (and the concurrent clients) on them, stop them."""
    procs, result = {}, {}
    try:
        for name, cmd in servers.items():
            procs[name] = start(cmd)
        ports = {name: port for name, (_, port) in procs.items()}
        for port in ports.values():  # warm up
            stream_chat(port, [{"role": "user", "content": "Hi"}], 4)
        if not a.skip_chat:
            chat = chat_run(ports, a.max_tokens)
            result["chat"] = {name: summary(chat[name]) for name in ports}
            result["same_text"] = chat["same_text"]
            result["turns"] = {name: chat[name] for name in ports}
        for n in a.levels:
            for name in ports:  # the servers in turn at each level, same requests
                result.setdefault("concurrent", {}).setdefault(name, []).append(
                    concurrent_run(ports[name], n, a.concurrent_tokens, a.per_client)
                )
    finally:
        for p, _ in procs.values():
            p.kill()
            p.wait(10)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft-model", default=None, help="also run mlx_lm.server --draft-model")
    ap.add_argument("--drafter", default=None, help="adaspec serve --drafter (default: auto)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrent", default="4", help="clients at once, e.g. 1,2,4,8 (0: skip)")
    ap.add_argument("--concurrent-tokens", type=int, default=96, help="max_tokens per request")
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends")
    ap.add_argument("--skip-chat", action="store_true", help="only the concurrent clients")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one-at-a-time", action="store_true", help="one server up at a time (memory)")
    ap.add_argument("--skip-plain", action="store_true", help="no plain mlx_lm.server (memory)")
    a = ap.parse_args()
    a.levels = [int(x) for x in a.concurrent.split(",") if int(x) > 0]

    import adaspec  # noqa: F401
    from adaspec.targets.loader import resolve

    folder = resolve(a.model)[0]
    servers = {
        "mlx_lm.server": [sys.executable, "-c", MLX_LM, "--model", folder],
        "adaspec serve": [sys.executable, "-m", "adaspec", "serve", "--model", folder],
    }
    if a.draft_model:
        draft = resolve(a.draft_model)[0]
        servers["mlx_lm.server --draft-model"] = [*servers["mlx_lm.server"], "--draft-model", draft]
        if a.drafter is None:
            a.drafter = f"auto:draft-model:{a.draft_model}"
    if a.drafter:
        servers["adaspec serve"] += ["--drafter", a.drafter]
    if a.skip_plain:
        del servers["mlx_lm.server"]
    groups = [list(servers)] if not a.one_at_a_time else [[n] for n in servers]
    result = {"model": a.model, "load": Path("/proc/loadavg").read_text().split()[:3]}
    for group in groups:
        result = merge(result, run_servers({n: servers[n] for n in group}, a))
    result["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    if "turns" in result:
        texts = [[t["text"] for t in turns] for turns in result["turns"].values()]
        result["same_text"] = [len(set(turn)) == 1 for turn in zip(*texts)]
    levels = list(zip(*result.get("concurrent", {}).values()))
    result["concurrent_same_text"] = [len({tuple(r["texts"]) for r in lv}) == 1 for lv in levels]
    for runs in result.get("concurrent", {}).values():
        for r in runs:
            r.pop("texts")
    print(json.dumps({k: v for k, v in result.items() if k != "turns"}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
