"""One registry mapping drafter names to factories; third parties join through the same door.

`make("pld+dflash:DIR", ...)` builds one drafter per arm; the policy picks among them per step.
A spec becomes drafters through a DrafterPlan (plan.py), where `auto` is expanded.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points

from ..errors import DrafterError
from ..settings import Settings
from ..targets.base import TargetInfo
from .base import DraftModel
from .spec import DrafterArgs, Entry

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "adaspec.drafters"

# factory(args, target, settings) -> DraftModel; args holds the arm's validated arguments.
Factory = Callable[[DrafterArgs, TargetInfo, Settings], DraftModel]


# built-in drafters: each module declares its own ENTRY (factory, typed arguments)
_BUILTINS = {
    "pld": "adaspec.drafters.pld:ENTRY",
    "dflash": "adaspec.drafters.dflash:ENTRY",
    "draft-model": "adaspec.drafters.draft_model:ENTRY",
    "suffix": "adaspec.drafters.suffix:ENTRY",
}
_FACTORIES: dict[str, Entry | str] = {}
_entry_points_loaded = False


def register(
    name: str,
    factory: Factory,
    *,
    options: Mapping[str, type] | None = None,
    path: str | None = "argument",
    replace: bool = False,
) -> None:
    """Make `factory` available as drafter `name` (`--drafter name[:PATH][,k=v]`, alone or as
    an arm of `a+b`). `options`: the KEY=VALUE arguments it takes and their types; `path`: what
    its positional argument is, or None if it takes none."""
    if not name or any(c in name for c in ":+,=") or name in ("none", "auto"):
        raise DrafterError(
            f"drafter name {name!r} is invalid; accepted: a non-empty name without ':', '+', "
            "',' or '=', other than 'none' and 'auto'"
        )
    # an entry point's module may register the name it is declared under (when imported)
    lazy = isinstance(_FACTORIES.get(name), str)
    if (name in _FACTORIES or name in _BUILTINS) and not (replace or lazy):
        raise DrafterError(f"drafter {name!r} is already registered; pass replace=True")
    _FACTORIES[name] = Entry(factory, dict(options or {}), path)


def _load_entry_points() -> None:
    """Entry points of the 'adaspec.drafters' group, and the ADASPEC_PLUGINS modules."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _FACTORIES:
            _FACTORIES[ep.name] = ep.value
    from .. import settings as settings_mod
    from . import plugins

    try:
        plugins.load(settings_mod.get().plugin_modules)
    except Exception:
        _entry_points_loaded = False  # the next lookup raises the same error
        raise


def names() -> list[str]:
    _load_entry_points()
    return sorted({*_BUILTINS, *_FACTORIES, "auto"})


def entry(name: str) -> Entry:
    """The registered Entry; a "module:attr" reference is imported on first use and may name
    an Entry or a bare factory (which takes a free positional argument and no KEY=VALUE)."""
    _load_entry_points()
    entry = _FACTORIES.get(name) or _BUILTINS.get(name)
    if entry is None:
        from .plugins import HOW_TO_REGISTER

        raise DrafterError(
            f"unknown drafter {name!r}; accepted: none, {', '.join(names())}; {HOW_TO_REGISTER}"
        )
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        obj = getattr(importlib.import_module(module), attr)
        registered = _FACTORIES.get(name)  # the module may have registered the name itself
        entry = registered if isinstance(registered, Entry) else obj
        entry = entry if isinstance(entry, Entry) else Entry(entry)
    return entry
