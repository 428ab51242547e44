"""llama.cpp as a peer (`adaspec bench --peer llama.cpp`): the same GGUF file and the same
prompt token ids, greedy, plain decoding (`llama`) and with its n-gram speculation
(`llama_ngram`: `--spec-type ngram-mod`, its default settings), each taking its turn per
prompt with mlx-lm's AR and adaspec.

llama.cpp runs as a `llama-server` binary (`--llama-server PATH`) or from the xllamacpp wheel
(bench/llama_server.py). The ngram-mod server is started again before every run: it keeps an
n-gram pool across requests, so a repeat would draft from its own earlier answer. Record
fields: `llama_tok_s`, `llama_ngram_tok_s`, `spec_vs_llama`, `spec_vs_llama_ngram`,
`ar_vs_llama`, and per mode the agreement of its text with adaspec's (`*_same_text`;
`*_agreement`: the share of the longer text the two share from its start; with a binary,
`*_first_divergence` in tokens), its drafted / accepted tokens, and whether llama.cpp
evaluated as many prompt tokens as it was given (`llama_prompt_match`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..errors import GenerationArgumentError
from .llama_server import (
    CTX,
    HttpServer,
    LlamaServer,
    ServerConfig,
    WheelServer,
    check_binary,
    check_env,
    server_args,
    wheel,
)
from .peers import (
    Column,
    PeerKind,
    PeerOptions,
    PeerReport,
    PeerRequest,
    Runner,
    first_divergence,
    med_field,
    med_rate,
    ratio,
)
from .timing import Run, median

NAME = "llama.cpp"
SPEC_TYPE = "ngram-mod"
MODES = {"llama": None, "llama_ngram": SPEC_TYPE}  # runner (and field prefix) -> --spec-type


def agreement(a: str, b: str) -> float:
    """The share of the longer of two texts that both share from their start (stripped)."""
    a, b = a.strip(), b.strip()
    longest = max(len(a), len(b))
    if not longest:
        return 1.0
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return round(same / longest, 4)


class LlamaPeer:
    """llama.cpp's servers by mode; `tokenizer` decodes adaspec's tokens for the text check."""

    name = NAME
    config_key = "llama_cpp"

    def __init__(self, servers: dict[str, LlamaServer], tokenizer: Any, info: dict) -> None:
        self.servers, self.tokenizer, self.info = servers, tokenizer, info

    def _run(self, mode: str, ids: list[int], max_tokens: int) -> Run:
        c = self.servers[mode].complete(ids, max_tokens)
        stats = {"text": c.text, "n": c.n, "prompt_ok": c.prompt_tokens == len(ids), **c.drafts}
        if c.tokens is not None:
            stats["token_ids"] = c.tokens
        return Run(c.tokens or [], c.e2e_s, c.decode_tok_s, stats)

    def runners(self) -> dict[str, Runner]:
        def runner(mode: str) -> Runner:
            return lambda ids, n: self._run(mode, ids, n)

        return {mode: runner(mode) for mode in self.servers}

    def warm(self, ids: list[int], prompts: Sequence[list[int]]) -> None:
        for mode in self.servers:
            self._run(mode, ids, 16)

    def describe(self) -> dict:
        return dict(self.info)

    def fields(self, runs: dict[str, list[Run]], ar: list[Run], spec: list[Run]) -> dict:
        return llama_fields(runs, ar, spec, self.tokenizer.decode(spec[0].tokens))

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


def llama_fields(runs: dict[str, list[Run]], ar: list[Run], spec: list[Run], text: str) -> dict:
    """llama.cpp's numbers for one prompt's record (medians over repeats); `text`: adaspec's."""
    out: dict = {}
    sp_tps = med_rate(spec)
    for mode in MODES:
        rs = runs[mode]
        tps, first = med_rate(rs), rs[0].stats
        out[f"{mode}_tok_s"] = round(tps, 2)
        out[f"{mode}_e2e_tok_s"] = round(median([first["n"] / r.e2e_s for r in rs]), 2)
        out[f"spec_vs_{mode}"] = ratio(sp_tps, tps)
        out[f"{mode}_same_text"] = first["text"].strip() == text.strip()
        out[f"{mode}_agreement"] = agreement(first["text"], text)
        if "token_ids" in first:
            out[f"{mode}_first_divergence"] = first_divergence(spec[0].tokens, first["token_ids"])
        out[f"{mode}_drafted"] = first.get("draft_n", 0)
        out[f"{mode}_accepted"] = first.get("draft_n_accepted", 0)
    out["ar_vs_llama"] = ratio(med_rate(ar), med_rate(runs["llama"]))
    out["llama_prompt_match"] = all(runs[m][0].stats["prompt_ok"] for m in MODES)
    return out


def llama_block(rs: list[dict]) -> dict:
    """Summary of the llama.cpp columns over records `rs`."""
    drafted = sum(r["llama_ngram_drafted"] for r in rs)
    accepted = sum(r["llama_ngram_accepted"] for r in rs)
    return {
        "median_llama_tok_s": med_field(rs, "llama_tok_s", 2),
        "median_llama_ngram_tok_s": med_field(rs, "llama_ngram_tok_s", 2),
        "median_spec_vs_llama": med_field(rs, "spec_vs_llama"),
        "median_spec_vs_llama_ngram": med_field(rs, "spec_vs_llama_ngram"),
        "median_ar_vs_llama": med_field(rs, "ar_vs_llama"),
        "llama_same_text": sum(r["llama_same_text"] for r in rs),
        "llama_ngram_same_text": sum(r["llama_ngram_same_text"] for r in rs),
        "median_llama_agreement": med_field(rs, "llama_agreement"),
        "llama_ngram_drafted": drafted,
        "llama_ngram_accepted": accepted,
        "llama_prompt_match": sum(r["llama_prompt_match"] for r in rs),
    }


def gguf_of(model_name: str) -> str:
    """The GGUF file of --model, or an error: llama.cpp reads GGUF files only."""
    from ..settings import get
    from ..targets import loader

    source = loader.gguf_source(model_name, get())
    if source is None:
        raise GenerationArgumentError(
            f"--peer llama.cpp runs llama.cpp on the model's GGUF file; --model {model_name!r} "
            "is not one; accepted: a catalogue name or a .gguf file"
        )
    return str(source[0])


def check(options: PeerOptions) -> None:
    """The llama.cpp flags, before the model loads: a runnable binary, or the wheel."""
    if options.llama_threads < 0:
        raise GenerationArgumentError(
            f"--llama-threads={options.llama_threads} is invalid; accepted: >= 1, or 0 (the "
            "cores this process may use)"
        )
    check_env(options.llama_env, options.llama_server)
    if options.llama_server:
        check_binary(options.llama_server)
    else:
        wheel()


def start(req: PeerRequest) -> LlamaPeer:
    o = req.options
    check(o)
    gguf = gguf_of(req.model_name)
    threads = o.llama_threads or len(os.sched_getaffinity(0))
    binary = check_binary(o.llama_server) if o.llama_server else None
    servers, flags = {}, {}
    for mode, spec in MODES.items():
        cfg = ServerConfig(gguf, threads, CTX, spec, env=o.llama_env)
        backend = HttpServer(binary, cfg) if binary else WheelServer(cfg)
        servers[mode], flags[mode] = LlamaServer(backend, fresh=spec is not None), server_args(cfg)
    info = {
        "name": NAME,
        "server": binary or "xllamacpp wheel",
        "build": servers["llama"].backend.build(),
        "gguf": gguf,
        "threads": threads,
        "env": list(o.llama_env),
        "flags": flags,
        "request": "/completion: the prompt as token ids, temperature 0, top_k 1, no prompt cache",
    }
    return LlamaPeer(servers, req.tokenizer, info)


def _same(b: dict, rs: list[dict]) -> str:
    return f"{b['llama_same_text']}/{b['prompts']}"


REPORT = PeerReport(
    key="llama_tok_s",
    block=llama_block,
    columns=(
        Column("llama.cpp tok/s", lambda b, rs: f"{b['median_llama_tok_s']:.1f}"),
        Column("spec vs llama.cpp", lambda b, rs: f"{b['median_spec_vs_llama']:.2f}x"),
        Column("ngram-mod tok/s", lambda b, rs: f"{b['median_llama_ngram_tok_s']:.1f}"),
        Column("spec vs ngram-mod", lambda b, rs: f"{b['median_spec_vs_llama_ngram']:.2f}x"),
        Column("same text as llama.cpp", _same),
    ),
    rates=(("llama.cpp", "llama_tok_s"), ("llama.cpp ngram-mod", "llama_ngram_tok_s")),
)
KIND = PeerKind(
    NAME,
    "llama.cpp on the same GGUF and prompt ids, plain and with ngram-mod speculation "
    "(--llama-server PATH, else the xllamacpp wheel)",
    REPORT,
    start,
    check,
)
