"""`adaspec serve` under load: R requests from N clients (held-out chats, T=0), a share of them
hanging up mid-stream. Checks that every completed text equals the one the same request gets
alone, that no slot leaks (N requests at once afterwards are all decoded together), and
reports resident memory as it goes, with the server's own account of it (arrays alive, mlx's
cache of freed buffers, the pooled prompt caches' KV bytes) from its log.

    python benchmarks/serve_load.py --model smollm2-135m --requests 400 --clients 8 --hang-up 0.1
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import held_out, stream_chat  # noqa: E402
from test_serve import free_port, get, rss_mb  # noqa: E402


def hang_up(port: int, messages: list, max_tokens: int, after: int) -> None:
    """Stream a request and close the socket after `after` chunks."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "stream": True}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        sock.sendall(head.encode() + body)
        got = b""
        while got.count(b"data:") < after:
            chunk = sock.recv(4096)
            if not chunk:
                return
            got += chunk


def start_logged(cmd: list[str], log: Path):
    import subprocess

    port = free_port()
    f = log.open("w")
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--log-level", "INFO"], stdout=f, stderr=subprocess.STDOUT
    )
    t0 = time.time()
    while time.time() - t0 < 300:
        try:
            if get(port, "/health")[0] == 200:
                return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server did not start")


def memory_lines(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        if "memory:" in line:
            out.append({k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--hang-up", type=float, default=0.1, help="share of clients hanging up")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--distinct", type=int, default=16, help="distinct requests, cycled")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import adaspec  # noqa: F401
    from adaspec.targets.loader import resolve

    folder = resolve(a.model)[0]
    log = Path(tempfile.mkdtemp()) / "serve.log"
    proc, port = start_logged([sys.executable, "-m", "adaspec", "serve", "--model", folder], log)
    asks = held_out(a.distinct)
    rng = random.Random(0)
    plan = [(i % a.distinct, rng.random() < a.hang_up) for i in range(a.requests)]
    try:
        alone = [stream_chat(port, m, a.max_tokens)["text"] for m in asks]
        rss, wrong, done = [("start", rss_mb(proc))], [], [0]

        def one(k: int) -> None:
            i, leave = plan[k]
            if leave:
                hang_up(port, asks[i], a.max_tokens, after=1 + k % 4)
            else:
                text = stream_chat(port, asks[i], a.max_tokens)["text"]
                if text != alone[i]:
                    wrong.append(k)
            done[0] += 1
            if done[0] % 50 == 0:
                rss.append((done[0], rss_mb(proc)))

        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.clients) as pool:
            list(pool.map(one, range(a.requests)))
        wall = time.perf_counter() - t0
        # no slot leaked: N requests at once are all taken and decoded together
        with ThreadPoolExecutor(a.clients) as pool:
            after = list(pool.map(lambda m: stream_chat(port, m, a.max_tokens), asks[: a.clients]))
        mem = memory_lines(log)
    finally:
        proc.kill()
        proc.wait(10)
    half = [mb for n, mb in rss if n != "start" and n >= a.requests // 2]
    result = {
        "model": a.model,
        "requests": a.requests,
        "clients": a.clients,
        "hung_up": sum(leave for _, leave in plan),
        "wrong_texts": wrong,
        "wall_s": round(wall, 1),
        "after_same_text": [r["text"] == alone[i] for i, r in enumerate(after)],
        "after_batch_size": [(r["adaspec"] or {}).get("batch_size") for r in after],
        "rss_mb": [(n, round(mb, 1)) for n, mb in rss],
        "last_half_growth": round(half[-1] / half[0] - 1, 4) if len(half) > 1 else None,
        "server_memory_first": mem[0] if mem else None,
        "server_memory_last": mem[-1] if mem else None,
        "load": Path("/proc/loadavg").read_text().split()[:3],
    }
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({**result, "server_memory": mem}, indent=1))
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
