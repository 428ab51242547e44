"""One target over several processes or machines (`mlx.launch`, `mpirun`): the model split
with mx.distributed, rank 0 drafting and deciding, every rank verifying its slice.

Layers: `world` (ranks, watchdog, bytes on the wire), `shard` (pipeline / tensor split),
`mirror` (rank 0's broadcast target and the other ranks' loop), `ranks` here (the entry a
command uses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import DistributedError


def run_ranks(model: Any, tokenizer: Any, kind: str, body: Callable[[], int]) -> int:
    """Shard `model` when this process is one of several ranks; rank 0 runs `body` (and
    alone prints), the others follow it. Returns the exit status."""
    from .world import world

    w = world()
    if w.size == 1:
        return body()
    from .mirror import follow, stop
    from .shard import shard

    shard(model, w, kind)
    if not w.leader:
        try:
            return follow(model, tokenizer, w)
        except DistributedError:
            raise
        except RuntimeError as exc:
            raise w.lost("following rank 0", exc) from exc
    try:
        status = body()
    except DistributedError:
        raise
    except RuntimeError as exc:
        if "[ring]" in str(exc) or "peer" in str(exc):
            raise w.lost("generating", exc) from exc
        stop(w)
        raise
    except BaseException:
        stop(w)
        raise
    stop(w)
    return status
