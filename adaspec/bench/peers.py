"""Peers of `adaspec bench --peer NAME[,NAME...]`: other decoders timed beside mlx-lm's AR and
adaspec on the same prompt ids, taking turns per prompt.

A peer kind (PeerKind) is a name, what the CLI needs to start one (`start`, given a PeerRequest)
and how its numbers are reported (PeerReport: the summary block over records, the markdown
columns, the tok/s series a plot draws). A started peer (the Peer protocol) brings runners (one
per timed column: a function of prompt ids and a token limit giving a bench Run), an untimed
warm-up, its configuration for the JSON, and the fields it adds to each prompt's record. The
kinds: `mlx-lm-spec` (bench/mlx_spec.py), `mlx-lm-stock` (bench/stock.py), `llama.cpp`
(bench/llamacpp.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .timing import Run, median

Runner = Callable[[list[int], int], Run]


class Peer(Protocol):
    """A started peer; close() ends what it started (a process, a server)."""

    name: str
    config_key: str  # where describe() goes in the bench JSON's config

    def runners(self) -> dict[str, Runner]: ...

    def warm(self, ids: list[int], prompts: Sequence[list[int]]) -> None: ...

    def describe(self) -> dict: ...

    def fields(self, runs: dict[str, list[Run]], ar: list[Run], spec: list[Run]) -> dict: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Column:
    """One markdown column: its header and its cell from a row's summary block and records."""

    header: str
    cell: Callable[[dict, list[dict]], str]


@dataclass(frozen=True)
class PeerReport:
    """key: the record field that says a record has this peer's fields; block: its summary
    over records; rates: (label, record field of a decode rate) for plots."""

    key: str
    block: Callable[[list[dict]], dict]
    columns: tuple[Column, ...]
    rates: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PeerOptions:
    """The CLI's peer flags (each peer reads its own)."""

    draft: str | None = None  # mlx-lm-spec: --peer-draft
    k: int = 0  # mlx-lm-spec: --peer-k
    tune_prompts: int = 2
    tune_tokens: int = 48
    llama_server: str | None = None  # llama.cpp: --llama-server PATH (else the wheel)
    llama_threads: int = 0  # llama.cpp: --llama-threads (0: this process's cores)
    llama_env: tuple[str, ...] = ()  # llama.cpp: --llama-env NAME=VALUE for the binary


@dataclass(frozen=True)
class PeerRequest:
    """What a peer kind starts from: the model as named and loaded, the drafter plan in use,
    the bench's sampler knobs and the peer flags."""

    model_name: str
    model: Any
    tokenizer: Any
    drafter: Any
    sampling: dict
    options: PeerOptions


@dataclass(frozen=True)
class PeerKind:
    name: str
    help: str
    report: PeerReport
    start: Callable[[PeerRequest], Peer]
    # checks the flags before the model loads (raises GenerationArgumentError)
    check: Callable[[PeerOptions], None] = lambda options: None


# --- helpers the kinds share ---


def ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else 0.0


def med_rate(runs: list[Run]) -> float:
    return median([r.decode_tok_s for r in runs])


def med_field(rs: list[dict], key: str, digits: int = 4) -> float:
    return round(median([r[key] for r in rs if key in r]), digits)


def first_divergence(ref: Sequence[int], got: Sequence[int]) -> int | None:
    """The first index where the token lists differ (the shorter's length when one is a
    prefix of the other); None when they are equal."""
    at = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if at is None and len(ref) != len(got):
        at = min(len(ref), len(got))
    return at
