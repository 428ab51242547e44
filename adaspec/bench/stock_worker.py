"""Stock mlx-lm in a process of its own: the `mlx-lm-stock` peer (adaspec/bench/stock.py starts
this file as a script, `python -I stock_worker.py`).

It imports mlx and mlx-lm and nothing of adaspec: mlx as its wheel ships it (its own CPU BLAS,
its compiled kernels built the way mlx builds them), the model as `mlx_lm.load` reads the
folder it is given (cast to fp32 where asked), and `mlx_lm.stream_generate` with mlx-lm's
sampler. One JSON request a line on stdin, one JSON reply a line on stdout (whatever a library
prints goes to stderr):

    {"op": "load", "model": PATH, "fp32": BOOL}
        -> {"ok": true, "load_s", "versions", "libraries", "adaspec_imported"}
    {"op": "run", "ids": [...], "max_tokens": N, "temp", "top_p", "min_p", "top_k", "seed"}
        -> {"ok": true, "tokens", "t0", "t_first", "t_end", "finish_reason", "last_text_empty"}

and {"ok": false, "error": "..."} when a request fails. Times are time.perf_counter()'s.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

# shared objects whose names say which BLAS (and whether anything of adaspec's) is mapped
LIBRARY_WORDS = ("blas", "mkl", "lapack", "accelerate", "adaspec")


def libraries() -> list[str]:
    """Names of the shared objects this process maps whose names contain LIBRARY_WORDS."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    names = {p.rsplit("/", 1)[-1] for p in paths}
    return sorted(n for n in names if any(w in n.lower() for w in LIBRARY_WORDS))


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for dist in ("mlx", "mlx-lm"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


class Worker:
    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None

    def load(self, req: dict) -> dict:
        import mlx.core as mx
        import mlx_lm

        t0 = time.perf_counter()
        self.model, self.tokenizer = mlx_lm.load(req["model"])[:2]
        if req.get("fp32"):
            self.model.set_dtype(mx.float32)
        mx.eval(self.model.parameters())
        return {
            "load_s": round(time.perf_counter() - t0, 3),
            "versions": versions(),
            "libraries": libraries(),
            "adaspec_imported": any(m.split(".")[0] == "adaspec" for m in sys.modules),
        }

    def run(self, req: dict) -> dict:
        import mlx.core as mx
        import mlx_lm
        from mlx_lm.sample_utils import make_sampler

        if self.model is None:
            raise RuntimeError("no model loaded: send a load request first")
        if req.get("seed") is not None:
            mx.random.seed(int(req["seed"]))
        sampler = make_sampler(
            temp=float(req.get("temp", 0.0)),
            top_p=float(req.get("top_p", 0.0)),
            min_p=float(req.get("min_p", 0.0)),
            top_k=int(req.get("top_k", 0)),
        )
        tokens: list[int] = []
        last = None
        t0 = time.perf_counter()
        t_first = None
        stream = mlx_lm.stream_generate(
            self.model,
            self.tokenizer,
            [int(t) for t in req["ids"]],
            max_tokens=int(req["max_tokens"]),
            sampler=sampler,
        )
        for r in stream:
            tokens.append(int(r.token))
            last = r
            if t_first is None:
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        return {
            "tokens": tokens,
            "t0": t0,
            "t_first": t_first if t_first is not None else t_end,
            "t_end": t_end,
            "finish_reason": getattr(last, "finish_reason", None),
            "last_text_empty": last is not None and last.text == "",
        }


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # the protocol alone goes to stdout
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "load":
                reply = {"ok": True, **worker.load(req)}
            elif op == "run":
                reply = {"ok": True, **worker.run(req)}
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}; accepted: load, run"}
        except Exception as exc:  # the parent reports it; the worker keeps serving
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
