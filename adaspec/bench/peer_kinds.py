"""The peer kinds `adaspec bench --peer` knows, by name: mlx-lm's speculative decoding
(mlx_spec), stock mlx-lm (stock) and llama.cpp (llamacpp), each built on the mechanism in
peers.py; and what the report takes from the kinds present in a run."""

from __future__ import annotations

from ..errors import GenerationArgumentError
from .llamacpp import KIND as LLAMA
from .mlx_spec import KIND as SPEC
from .peers import PeerKind, PeerReport
from .stock import KIND as STOCK


def kinds() -> dict[str, PeerKind]:
    """Every peer kind by name."""
    return {k.name: k for k in (SPEC, STOCK, LLAMA)}


def peer_names(peer: str | None) -> list[str]:
    """The peers a --peer value names (one, or several joined by commas), each checked."""
    names = [n.strip() for n in (peer or "").split(",") if n.strip()]
    known = kinds()
    for name in names:
        if name not in known:
            raise GenerationArgumentError(
                f"--peer {name!r} is unknown; accepted: {', '.join(known)} (or several, joined "
                "by commas)"
            )
    return list(dict.fromkeys(names))


def report_blocks(rs: list[dict]) -> dict:
    """Every present peer's summary block over records `rs`."""
    out: dict = {}
    for kind in kinds().values():
        if rs and kind.report.key in rs[0]:
            out.update(kind.report.block(rs))
    return out


def present(records: list[dict]) -> list[PeerReport]:
    """The reports of the peers whose fields the records carry."""
    return [k.report for k in kinds().values() if records and k.report.key in records[0]]
