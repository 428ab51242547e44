"""Does `adaspec serve` get faster on the workload it serves? N new conversations of one kind
(4 turns each), each turn sent to `adaspec serve` (default `auto`, whose suffix arm learns
every response) and to plain `mlx_lm.server`, interleaved; reports decode tok/s and the speedup
over plain and tau per conversation, the last 5 against the first 5, and whether the texts
match.

    python benchmarks/suffix_serve.py --model smollm2-135m --conversations 20 --json FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serve import MLX_LM, stream_chat  # noqa: E402
from test_serve import start  # noqa: E402

SUBJECTS = [
    "a lighthouse keeper", "a clockmaker", "a beekeeper", "a glassblower", "a cartographer",
    "a violin maker", "a night-train conductor", "a mushroom forager", "a bridge engineer",
    "a puppeteer", "a lock-picker", "a falconer", "a bookbinder", "a tugboat captain",
    "a snow plough driver", "a perfumer", "a stonemason", "a radio operator", "a tea taster",
    "a kite maker", "a diver", "a cheesemaker", "a map thief", "a chimney sweep",
]  # fmt: skip
TURNS = [
    "Write a short story about {s} who finds something unexpected.",
    "Continue the story: what happens next?",
    "Give the story a title and summarize it in two sentences.",
    "Rewrite the opening paragraph so a five-year-old would enjoy it.",
]


def conversation(ports: dict, subject: str, max_tokens: int) -> dict:
    """The 4 turns to every server; the history follows the first server's replies."""
    messages: list = []
    out: dict = {name: [] for name in ports}
    same = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn.format(s=subject)})
        replies = {name: stream_chat(port, messages, max_tokens) for name, port in ports.items()}
        for name, r in replies.items():
            out[name].append(r)
        texts = [r["text"] for r in replies.values()]
        same.append(len(set(texts)) == 1)
        messages.append({"role": "assistant", "content": texts[0]})
    return {"turns": out, "same_text": same}


def decode_tps(turns: list[dict]) -> float:
    toks = sum(t["tokens"] - 1 for t in turns)
    secs = sum((t["tokens"] - 1) / t["decode_tps"] for t in turns if t["decode_tps"])
    return toks / secs if secs else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="adaspec serve --drafter (default: auto)")
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import adaspec  # noqa: F401
    from adaspec.targets.loader import resolve

    folder = resolve(a.model)[0]
    servers = {
        "adaspec serve": [sys.executable, "-m", "adaspec", "serve", "--model", folder],
        "mlx_lm.server": [sys.executable, "-c", MLX_LM, "--model", folder],
    }
    if a.drafter:
        servers["adaspec serve"] += ["--drafter", a.drafter]
    procs = {}
    rows = []
    try:
        for name, cmd in servers.items():
            procs[name] = start(cmd)
        ports = {name: port for name, (_, port) in procs.items()}
        for port in ports.values():  # warm up
            stream_chat(port, [{"role": "user", "content": "Hi"}], 4)
        for i in range(a.conversations):
            c = conversation(ports, SUBJECTS[i % len(SUBJECTS)], a.max_tokens)
            spec, plain = (
                decode_tps(c["turns"]["adaspec serve"]),
                decode_tps(c["turns"]["mlx_lm.server"]),
            )
            rows.append(
                {
                    "subject": SUBJECTS[i % len(SUBJECTS)],
                    "adaspec_tps": round(spec, 2),
                    "plain_tps": round(plain, 2),
                    "speedup": round(spec / plain, 3) if plain else 0.0,
                    "tau": round(
                        statistics.mean(
                            (t["adaspec"] or {}).get("tau", 1.0)
                            for t in c["turns"]["adaspec serve"]
                        ),
                        3,
                    ),
                    "same_text": c["same_text"],
                    "usage": [t["adaspec"] for t in c["turns"]["adaspec serve"]],
                }
            )
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "usage"}), flush=True)
    finally:
        for p, _ in procs.values():
            p.kill()
            p.wait(10)
    first, last = rows[:5], rows[-5:]

    def med(rs, key):
        return statistics.median(r[key] for r in rs)

    result = {
        "model": a.model,
        "conversations": rows,
        "first5": {k: med(first, k) for k in ("adaspec_tps", "speedup", "tau")},
        "last5": {k: med(last, k) for k in ("adaspec_tps", "speedup", "tau")},
        "identical_turns": sum(sum(r["same_text"]) for r in rows),
        "turns": sum(len(r["same_text"]) for r in rows),
        "load": Path("/proc/loadavg").read_text().split()[:3],
    }
    result["last5_over_first5"] = {
        k: round(result["last5"][k] / result["first5"][k], 3)
        for k in ("adaspec_tps", "speedup", "tau")
    }
    print(json.dumps({k: v for k, v in result.items() if k != "conversations"}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
