"""One registry mapping drafter names to factories; third parties join through the same door.

`make("pld+dflash:DIR", ...)` builds one drafter per arm; the policy picks among them per step.
`auto` is the name of each target's default combination (see `expand_auto`).
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
from .spec import ArmSpec, DrafterArgs, Entry, split_arms

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


def _entry(name: str) -> Entry:
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


def expand_auto(arm: ArmSpec, info: TargetInfo, settings: Settings) -> list[ArmSpec]:
    """`auto` is each target's default combination: prompt lookup (matches of at least
    ADASPEC_AUTO_PLD_MIN_MATCH tokens, or min_match=N), then suffix lookup over the target's
    earlier outputs (the data file shipped for the target, if any, and what the process
    generated), then prompt lookup's shorter matches, in front of a model drafter: the DFlash
    checkpoint shipped for the target (`auto`, where that checkpoint is marked as beating PLD
    alone: dflash.in_auto), the DFlash folder named (`auto:DIR[,block=N...]`) or any other
    drafter (`auto:draft-model:NAME[,k=v]`). The suffix arm is left out in front of DFlash,
    where it was measured not to pay (docs/drafters.md); suffix=true|false decides instead.
    Each arm keeps its own estimates; the policy weighs them per step."""
    from .dflash import default_checkpoint, in_auto

    options = dict(arm.options)
    min_match = _min_match(arm, options.pop("min_match", str(settings.auto_pld_min_match)))
    wanted = options.pop("suffix", None)
    rest = tuple(options.items())
    inner_name, sep, inner_path = (arm.path or "").partition(":")
    if inner_name in ("auto", "pld", "none", "suffix"):
        raise DrafterError(
            f"{arm} is invalid: PLD and suffix lookup already come first; accepted: "
            "auto[:DIR] (DFlash) or auto:SPEC with SPEC another drafter, e.g. "
            "auto:draft-model:NAME"
        )
    if arm.path is None:
        shipped = default_checkpoint(info)
        model = None if not rest and (shipped is None or not in_auto(shipped)) else "dflash"
        model_arm = ArmSpec("dflash", None, rest)
    elif inner_name not in names():  # auto:DIR
        model, model_arm = "dflash", ArmSpec("dflash", arm.path, rest)
    else:
        model = inner_name
        model_arm = ArmSpec(inner_name, inner_path or None if sep else None, rest)
    use_suffix = _flag(arm, "suffix", wanted) if wanted is not None else model != "dflash"
    lookups = [ArmSpec("pld", None, (("min_ngram", str(min_match)),))]
    if use_suffix:
        lookups.append(ArmSpec("suffix", None, SUFFIX_IN_AUTO))
    # the short-match arm: in front of DFlash (measured there) and behind the suffix arm
    if min_match > 1 and (model == "dflash" or (model is None and use_suffix)):
        lookups.append(ArmSpec("pld", None, (("min_ngram", "1"),)))
    if model is None:
        return lookups if use_suffix else [ArmSpec("pld")]
    return [*lookups, model_arm]


# the suffix arm's options in `auto`: prompt lookup in front covers the request's own text
# (benchmarks/suffix_replay.py: the same tau, less drafting time)
SUFFIX_IN_AUTO = (("context", "false"),)


def _flag(arm: ArmSpec, key: str, value: str) -> bool:
    v = value.strip().lower()
    if v not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise DrafterError(f"{arm}: {key}={value!r} is invalid; accepted: true or false")
    return v in ("1", "true", "yes", "on")


def _min_match(arm: ArmSpec, value: str) -> int:
    """auto's min_match option as a number of tokens, refused naming the value."""
    try:
        n = int(value.strip())
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise DrafterError(f"{arm}: min_match={value!r} is invalid; accepted: an integer 1..64")
    return n


def arms(spec: str, info: TargetInfo, settings: Settings) -> list[ArmSpec]:
    """The arms `spec` names, `auto` expanded; [] for 'none' (plain AR)."""
    if spec.strip() == "none":
        return []
    out: list[ArmSpec] = []
    for arm in split_arms(spec):
        if arm.name == "none":
            raise DrafterError(f"drafter spec {spec!r}: 'none' cannot be an arm of a combination")
        out += expand_auto(arm, info, settings) if arm.name == "auto" else [arm]
    return out


def make_arms(spec: str, info: TargetInfo, settings: Settings) -> list[DraftModel]:
    """One drafter per arm of `spec` ('none' gives [], i.e. plain AR)."""
    return [_entry(a.name).build(a, info, settings) for a in arms(spec, info, settings)]


def make(spec: str, info: TargetInfo, settings: Settings) -> DraftModel | None:
    """The one drafter `spec` names ('none' gives None, i.e. plain AR); a spec naming several
    arms (`a+b`, or `auto` where it combines two) goes through `make_arms`."""
    built = make_arms(spec, info, settings)
    if len(built) > 1:
        raise DrafterError(
            f"drafter spec {spec!r} names {len(built)} drafters; accepted here: one (use "
            "make_arms, or pass the spec to generate/stream_generate, for several)"
        )
    return built[0] if built else None


def default_spec(info: TargetInfo) -> str:
    """The drafter the CLI uses when none is named: `auto` (prompt lookup, suffix lookup and,
    where one ships marked as paying, the target's DFlash drafter)."""
    return "auto"
