"""One target over several processes or machines (`mlx.launch`, `mpirun`): the model split
with mx.distributed, rank 0 drafting and deciding, every rank verifying its slice.

Layers: `world` (ranks, watchdog, bytes on the wire), `shard` (pipeline / tensor split),
`mirror` (rank 0's broadcast target and the other ranks' loop), and here `run_ranks` (the entry
a command uses) and `target_for` (the target a generation decodes on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import DistributedError

if TYPE_CHECKING:
    from ..settings import Settings
    from ..targets.base import Target


def target_for(model: Any, tokenizer: Any, settings: Settings) -> Target:
    """The target a generation on `model` decodes on: rank 0's mirrored target when the model
    is split over ranks (`shard`), else targets.target_for's (the settings' prefill chunk,
    rollback strategy and pieces)."""
    from ..targets import target_for as local_target_for
    from .shard import sharding

    if sharding(model) is None:
        return local_target_for(model, tokenizer, settings)
    from .mirror import leader_target

    target = leader_target(model, tokenizer, settings.prefill_step)
    target.pieces = settings.forward_pieces  # type: ignore[attr-defined]
    return target  # type: ignore[return-value]


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
