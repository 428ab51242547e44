"""Stock mlx-lm as a peer (`adaspec bench --peer mlx-lm-stock`, `adaspec generate
--compare-stock`): mlx-lm as a user installs it, in a process that never imports adaspec.

The worker (stock_worker.py, started as a script with `python -I`) loads the model as stock
mlx-lm reads it: a GGUF or catalogue model as adaspec's fp32 expansion of it (the mlx-lm folder
adaspec converts it into once, under ADASPEC_CACHE/models), an mlx-lm folder or Hugging Face id
as it is, cast to fp32 where adaspec computes its half-precision weights in fp32. mlx runs with
its wheel's own CPU BLAS and builds its compiled kernels the way it does without adaspec: the
worker's environment is this process's without what adaspec changed in it (the `g++` wrapper
on PATH and TMPDIR of kernels/jit.py, the allocator tunable of cli/malloc.py). It is given the
same prompt ids, token limit and sampler knobs as the other columns, runs one short generation
before anything is timed, and is timed as the AR column is (bench/timing.py: the tokens after
the first over the time after it, EOS not counted). Requests take turns with this process's
runs (the worker waits while adaspec runs and the other way round), so neither competes for
the cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import AdaspecError
from .peers import Column, PeerKind, PeerReport, PeerRequest, Runner, first_divergence, ratio
from .timing import Run, median

NAME = "mlx-lm-stock"
WORKER = Path(__file__).with_name("stock_worker.py")
WARM_TOKENS = 16


class StockPeerError(AdaspecError):
    """The stock mlx-lm worker failed (its message and the end of its stderr)."""


@dataclass(frozen=True)
class StockSource:
    """What the worker loads: `path` for mlx_lm.load, `fp32`: cast the weights to fp32."""

    path: str
    fp32: bool


def stock_source(name: str, settings: Any = None) -> StockSource:
    """The model `name` (as `adaspec.load` takes it) as stock mlx-lm reads it; a GGUF is
    converted to its fp32 expansion here if the cache does not hold it yet."""
    from ..settings import get
    from ..targets import loader, stored_model

    settings = settings or get()
    path, from_gguf = loader.resolve(name, settings=settings)
    return StockSource(path, not from_gguf and stored_model.enabled(settings))


def _is_jit_wrapper(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "g++"), "rb") as f:
            return b"adaspec/kernels/jit.py" in f.read(200)
    except OSError:
        return False


def worker_env(env: dict[str, str] | None = None, tcache: int | None = None) -> dict[str, str]:
    """`env` (default: this process's) without what adaspec put there: the JIT's `g++`
    wrapper on PATH, TMPDIR pointed at adaspec's kernel cache, the glibc tunable the `adaspec`
    command adds (`tcache`: its chunk count, default the settings')."""
    from ..kernels import jit
    from ..settings import get

    env = dict(os.environ if env is None else env)
    env["PATH"] = os.pathsep.join(
        d for d in env.get("PATH", "").split(os.pathsep) if d and not _is_jit_wrapper(d)
    )
    st = jit.status()
    if st is not None and st.directory is not None and env.get("TMPDIR") == str(st.directory):
        env["TMPDIR"] = tempfile.gettempdir()  # Python pinned it before the JIT changed it
    count = get().malloc_tcache if tcache is None else tcache
    tunables = env.get("GLIBC_TUNABLES")
    if tunables is not None:
        ours = f"glibc.malloc.tcache_count={count}"
        kept = [t for t in tunables.split(":") if t and t != ours]
        if kept:
            env["GLIBC_TUNABLES"] = ":".join(kept)
        else:
            del env["GLIBC_TUNABLES"]
    return env


def run_of(reply: dict) -> Run:
    """A worker's reply to a run request as a bench Run, counted as bench/timing.py counts."""
    tokens = list(reply["tokens"])
    if reply.get("finish_reason") == "stop" and reply.get("last_text_empty") and tokens:
        tokens = tokens[:-1]  # EOS is not output
    n_after = len(tokens) - 1
    dt = reply["t_end"] - reply["t_first"]
    rate = n_after / dt if dt > 0 and n_after > 0 else 0.0
    return Run(tokens, reply["t_end"] - reply["t0"], rate)


class StockPeer:
    """One stock mlx-lm worker serving runs of `source` with the sampler knobs `sampling`
    (temp, top_p, top_k, min_p, seed); `run(ids, max_tokens)` -> Run. Close it (or use it as
    a context manager) to end the worker. `info`: what the worker reported at load (seconds,
    versions, the BLAS libraries it maps)."""

    name = NAME
    config_key = "stock"

    def __init__(self, source: StockSource, sampling: dict | None = None) -> None:
        self.source, self.sampling = source, dict(sampling or {})
        self.info: dict = {}
        self._stderr: IO[str] = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-I", str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=worker_env(),
        )
        try:
            self.info = self._ask(
                {"op": "load", "model": self.source.path, "fp32": self.source.fp32}
            )
        except BaseException:
            self.close()
            raise
        if self.info.get("adaspec_imported"):
            self.close()
            raise StockPeerError("the stock mlx-lm worker imported adaspec; it must not")

    def _tail(self) -> str:
        self._stderr.seek(0)
        lines = self._stderr.read().strip().splitlines()
        return " | ".join(lines[-5:])

    def _ask(self, request: dict) -> dict:
        proc = self._proc
        if proc.stdin is None or proc.stdout is None:
            raise StockPeerError("the stock mlx-lm worker has no pipes")
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except OSError as exc:
            line = ""
            err = f"{type(exc).__name__}: {exc}"
        else:
            err = ""
        if not line:
            proc.wait(timeout=30)
            raise StockPeerError(
                f"the stock mlx-lm worker ended (exit {proc.returncode}) {err}: {self._tail()}"
            )
        reply = json.loads(line)
        if not reply.get("ok"):
            raise StockPeerError(f"stock mlx-lm: {reply.get('error')}")
        return reply

    def run(self, ids: list[int], max_tokens: int) -> Run:
        keys = ("temp", "top_p", "top_k", "min_p", "seed")
        knobs = {k: self.sampling[k] for k in keys if self.sampling.get(k) is not None}
        request = {"op": "run", "ids": [int(t) for t in ids], "max_tokens": max_tokens, **knobs}
        return run_of(self._ask(request))

    def runners(self) -> dict[str, Runner]:
        return {"stock": self.run}

    def warm(self, ids: list[int], prompts: Sequence[list[int]] = ()) -> None:
        """One untimed generation: stock mlx builds (or loads) its kernels now."""
        self.run(ids, WARM_TOKENS)

    def fields(self, runs: dict[str, list[Run]], ar: list[Run], spec: list[Run]) -> dict:
        return stock_fields(runs["stock"], ar, spec)

    def describe(self) -> dict:
        """The peer's configuration for a bench's JSON."""
        keep = ("load_s", "versions", "libraries")
        return {
            "name": NAME,
            "model": self.source.path,
            "fp32": self.source.fp32,
            **{k: self.info[k] for k in keep if k in self.info},
        }

    def close(self) -> None:
        proc = self._proc
        if proc.poll() is None:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        self._stderr.close()

    def __enter__(self) -> StockPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stock_fields(stock: list[Run], ar: list[Run], spec: list[Run]) -> dict:
    """Stock mlx-lm's numbers for one prompt's bench record (medians over repeats); identical:
    its tokens against adaspec's."""
    tps = median([r.decode_tok_s for r in stock])
    e2e = median([len(r.tokens) / r.e2e_s for r in stock if r.e2e_s > 0])
    ar_tps = median([r.decode_tok_s for r in ar])
    sp_tps = median([r.decode_tok_s for r in spec])
    ref, got = spec[0].tokens, stock[0].tokens
    return {
        "stock_tok_s": round(tps, 2),
        "stock_e2e_tok_s": round(e2e, 2),
        "spec_vs_stock": ratio(sp_tps, tps),
        "ar_vs_stock": ratio(ar_tps, tps),
        "stock_identical": ref == got,
        "stock_first_divergence": first_divergence(ref, got),
    }


def stock_block(rs: list[dict]) -> dict:
    """Summary of the stock columns over records `rs` (empty without the stock peer)."""
    if not rs or "stock_tok_s" not in rs[0]:
        return {}
    return {
        "median_stock_tok_s": round(median([r["stock_tok_s"] for r in rs]), 2),
        "median_spec_vs_stock": round(median([r["spec_vs_stock"] for r in rs]), 4),
        "median_ar_vs_stock": round(median([r["ar_vs_stock"] for r in rs]), 4),
        "min_spec_vs_stock": round(min(r["spec_vs_stock"] for r in rs), 4),
        "stock_identical": sum(r["stock_identical"] for r in rs),
    }


def start(req: PeerRequest) -> StockPeer:
    """The worker, started and its model loaded."""
    return StockPeer(stock_source(req.model_name), req.sampling)


REPORT = PeerReport(
    key="stock_tok_s",
    block=stock_block,
    columns=(
        Column("stock mlx-lm tok/s", lambda b, rs: f"{b['median_stock_tok_s']:.1f}"),
        Column("spec vs stock", lambda b, rs: f"{b['median_spec_vs_stock']:.2f}x"),
        Column("identical to stock", lambda b, rs: f"{b['stock_identical']}/{b['prompts']}"),
    ),
    rates=(("stock mlx-lm", "stock_tok_s"),),
)
KIND = PeerKind(
    NAME,
    "stock mlx-lm in a process that never imports adaspec (the mlx wheel's own BLAS and "
    "kernels, the model's fp32 expansion)",
    REPORT,
    start,
)
