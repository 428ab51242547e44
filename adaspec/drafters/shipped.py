"""The drafters adaspec ships for a target: DFlash checkpoints under drafters/checkpoints,
found by the target's architecture and shapes, and whether `auto` puts one behind the lookups.
(Suffix data files are found the same way by suffix_store.shipped_data.)"""

from __future__ import annotations

import json
from pathlib import Path

from ..targets.base import TargetInfo

CHECKPOINTS = Path(__file__).parent / "checkpoints"


def default_checkpoint(info: TargetInfo) -> Path | None:
    """The DFlash checkpoint shipped with adaspec for this target, if any: a folder under
    drafters/checkpoints whose config names the target's architecture and matches its
    vocabulary, hidden size and layer count."""
    for cfg_file in sorted(CHECKPOINTS.glob("*/config.json")):
        cfg = json.loads(cfg_file.read_text())
        target = cfg.get("adaspec_target") or {}
        if (
            target.get("model_type") == info.model_type
            and cfg.get("vocab_size") == info.vocab_size
            and cfg.get("hidden_size") == info.hidden_size
            and cfg.get("num_target_layers") == info.num_layers
        ):
            return cfg_file.parent
    return None


def in_auto(folder: Path) -> bool:
    """Whether `auto` puts this shipped checkpoint behind prompt lookup: its config says so
    (`adaspec_target.in_auto`), which is set once the combination is measured to beat `pld`
    alone on the development suite. Unmarked, `dflash` still loads it; `auto` leaves it out."""
    cfg = json.loads((folder / "config.json").read_text())
    return bool((cfg.get("adaspec_target") or {}).get("in_auto", False))


def auto_checkpoint(info: TargetInfo) -> Path | None:
    """The shipped DFlash checkpoint `auto` uses for this target, or None."""
    folder = default_checkpoint(info)
    return folder if folder is not None and in_auto(folder) else None
