"""One registry mapping drafter names to factories; third parties join through the same door."""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points

from ..errors import DrafterError
from ..settings import Settings
from ..targets.base import TargetInfo
from .base import DraftModel

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "adaspec.drafters"

# factory(arg, target, settings) -> DraftModel; `arg` is the text after "name:" (or None).
Factory = Callable[[str | None, TargetInfo, Settings], DraftModel]

_FACTORIES: dict[str, Factory] = {}
_BUILTINS = {
    "pld": "adaspec.drafters.pld:factory",
    "dflash": "adaspec.drafters.dflash:factory",
    "auto": "adaspec.drafters.auto:factory",
    "draft-model": "adaspec.drafters.draft_model:factory",
}
_entry_points_loaded = False


def register(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Make `factory` available as drafter `name` (e.g. `--drafter name:ARG`)."""
    if not name or ":" in name or name == "none":
        raise DrafterError(f"drafter name {name!r} is invalid: use a non-empty name without ':'")
    if name in _FACTORIES and not replace:
        raise DrafterError(f"drafter {name!r} is already registered; pass replace=True")
    _FACTORIES[name] = factory


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _FACTORIES:
            _FACTORIES[ep.name] = _lazy(ep.value)


def _lazy(target: str) -> Factory:
    def factory(arg: str | None, info: TargetInfo, settings: Settings) -> DraftModel:
        import importlib

        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)(arg, info, settings)

    return factory


def names() -> list[str]:
    _load_entry_points()
    return sorted({*_BUILTINS, *_FACTORIES})


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'name' or 'name:ARG' -> (name, ARG)."""
    name, sep, arg = spec.partition(":")
    return name.strip(), (arg if sep else None)


def make(spec: str, info: TargetInfo, settings: Settings) -> DraftModel | None:
    """Build the drafter named by `spec` ('none' gives None, i.e. plain AR)."""
    name, arg = parse_spec(spec)
    if name in ("none", ""):
        return None
    _load_entry_points()
    factory = _FACTORIES.get(name)
    if factory is None and name in _BUILTINS:
        factory = _lazy(_BUILTINS[name])
    if factory is None:
        raise DrafterError(f"unknown drafter {name!r}; accepted: none, {', '.join(names())}")
    return factory(arg, info, settings)


def default_spec(info: TargetInfo) -> str:
    """The drafter the CLI uses when none is named: "auto" (PLD + the shipped DFlash drafter)
    for targets adaspec ships a drafter for, "pld" otherwise."""
    from .dflash import default_checkpoint

    return "auto" if default_checkpoint(info) is not None else "pld"
