"""The drafter plan: what a spec string becomes at the boundary (CLI, serve request, Python
API), once: its arms in order, each with its registered factory and validated arguments, and
`auto` expanded here and nowhere else, from the drafters shipped for the target.

    plan("auto", info, settings)      -> DrafterPlan(pld:min_ngram=2 + suffix + pld:min_ngram=1)
    plan(...).build(info, settings)   -> the drafters, one per arm
    check("pld+nope")                 -> DrafterError, without a model (serve checks requests)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DrafterError
from ..settings import Settings
from ..targets.base import TargetInfo
from .base import DraftModel
from .spec import ArmSpec, DrafterArgs, Entry, split_arms, validate

DEFAULT = "auto"  # the spec the CLI and serve use when none is named

# the suffix arm's options in `auto`: prompt lookup in front covers the request's own text
# (benchmarks/suffix_replay.py: the same tau, less drafting time)
SUFFIX_IN_AUTO = (("context", "false"),)
_LOOKUPS = ("auto", "pld", "none", "suffix")  # what `auto:SPEC` may not name


@dataclass(frozen=True)
class PlannedArm:
    """One arm: as written (after `auto`'s expansion), its registry entry, its typed arguments."""

    spec: ArmSpec
    entry: Entry
    args: DrafterArgs

    @property
    def name(self) -> str:
        return self.spec.name

    def build(self, info: TargetInfo, settings: Settings) -> DraftModel:
        return self.entry.factory(self.args, info, settings)


@dataclass(frozen=True)
class DrafterPlan:
    """The drafters one generation runs, in the order the policy asks them; no arms = plain
    AR. `source` is the spec as given (str() shows it); `expanded()` the arms as specs."""

    arms: tuple[PlannedArm, ...]
    source: str

    def __str__(self) -> str:
        return self.source

    def expanded(self) -> str:
        return "+".join(str(a.spec) for a in self.arms) or "none"

    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.arms)

    def find(self, name: str) -> PlannedArm | None:
        """The first arm of drafter `name`, if any."""
        return next((a for a in self.arms if a.name == name), None)

    def build(self, info: TargetInfo, settings: Settings) -> list[DraftModel]:
        return [a.build(info, settings) for a in self.arms]


def plan(spec: str | DrafterPlan, info: TargetInfo, settings: Settings) -> DrafterPlan:
    """`spec` for this target: parsed, `auto` expanded, every arm's arguments validated
    against what its drafter declares (nothing is built yet). A plan passes through."""
    if isinstance(spec, DrafterPlan):
        return spec
    arms: list[ArmSpec] = []
    for arm in _arms(spec):
        arms += _expand_auto(arm, info, settings) if arm.name == "auto" else [arm]
    return DrafterPlan(tuple(_planned(a) for a in arms), spec.strip())


def make_arms(spec: str | DrafterPlan, info: TargetInfo, settings: Settings) -> list[DraftModel]:
    """One drafter per arm of `spec` ('none' gives [], i.e. plain AR)."""
    return plan(spec, info, settings).build(info, settings)


def make(spec: str | DrafterPlan, info: TargetInfo, settings: Settings) -> DraftModel | None:
    """The one drafter `spec` names ('none' gives None, i.e. plain AR); a spec naming several
    arms (`a+b`, or `auto` where it combines two) goes through `make_arms`."""
    built = make_arms(spec, info, settings)
    if len(built) > 1:
        raise DrafterError(
            f"drafter spec {str(spec)!r} names {len(built)} drafters; accepted here: one (use "
            "make_arms, or pass the spec to generate/stream_generate, for several)"
        )
    return built[0] if built else None


def default_spec(info: TargetInfo) -> str:
    """The drafter the CLI uses when none is named: `auto` (prompt lookup, suffix lookup and,
    where one ships marked as paying, the target's DFlash drafter; expanded by `plan`)."""
    return DEFAULT


def check(spec: str) -> None:
    """Refuse `spec` if it cannot become a plan on any target: its syntax, its drafter names,
    the arguments of every arm but `auto`'s model arm (which depends on the target)."""
    for arm in _arms(spec):
        if arm.name == "auto":
            _auto_options(arm, min_match_default=1)
        else:
            _planned(arm)


def _arms(spec: str) -> list[ArmSpec]:
    if isinstance(spec, str) and spec.strip() == "none":
        return []
    arms = split_arms(spec)
    if any(a.name == "none" for a in arms):
        raise DrafterError(f"drafter spec {spec!r}: 'none' cannot be an arm of a combination")
    return arms


def _planned(arm: ArmSpec) -> PlannedArm:
    from .registry import entry

    e = entry(arm.name)
    return PlannedArm(arm, e, validate(arm, e.options, e.path))


@dataclass(frozen=True)
class _AutoOptions:
    min_match: int
    suffix: bool | None  # None: decided by the model arm
    rest: tuple[tuple[str, str], ...]  # the model arm's own options


def _auto_options(arm: ArmSpec, min_match_default: int) -> _AutoOptions:
    """auto's own options, checked; what else it was given goes to its model arm."""
    options = dict(arm.options)
    min_match = _min_match(arm, options.pop("min_match", str(min_match_default)))
    wanted = options.pop("suffix", None)
    if (arm.path or "").partition(":")[0] in _LOOKUPS:
        raise DrafterError(
            f"{arm} is invalid: PLD and suffix lookup already come first; accepted: "
            "auto[:DIR] (DFlash) or auto:SPEC with SPEC another drafter, e.g. "
            "auto:draft-model:NAME"
        )
    suffix = None if wanted is None else _flag(arm, "suffix", wanted)
    return _AutoOptions(min_match, suffix, tuple(options.items()))


def _expand_auto(arm: ArmSpec, info: TargetInfo, settings: Settings) -> list[ArmSpec]:
    """`auto` is each target's default combination: prompt lookup (matches of at least
    ADASPEC_AUTO_PLD_MIN_MATCH tokens, or min_match=N), then suffix lookup over the target's
    earlier outputs (the data file shipped for the target, if any, and what the process
    generated), then prompt lookup's shorter matches, in front of a model drafter: the DFlash
    checkpoint shipped for the target (`auto`, where that checkpoint is marked as beating PLD
    alone: shipped.in_auto), the DFlash folder named (`auto:DIR[,block=N...]`) or any other
    drafter (`auto:draft-model:NAME[,k=v]`). The suffix arm is left out in front of DFlash,
    where it was measured not to pay (docs/drafters.md); suffix=true|false decides instead.
    Each arm keeps its own estimates; the policy weighs them per step."""
    from .registry import names
    from .shipped import auto_checkpoint

    opts = _auto_options(arm, settings.auto_pld_min_match)
    inner_name, sep, inner_path = (arm.path or "").partition(":")
    if arm.path is None:
        model = None if not opts.rest and auto_checkpoint(info) is None else "dflash"
        model_arm = ArmSpec("dflash", None, opts.rest)
    elif inner_name not in names():  # auto:DIR
        model, model_arm = "dflash", ArmSpec("dflash", arm.path, opts.rest)
    else:
        model = inner_name
        model_arm = ArmSpec(inner_name, inner_path or None if sep else None, opts.rest)
    use_suffix = opts.suffix if opts.suffix is not None else model != "dflash"
    lookups = [ArmSpec("pld", None, (("min_ngram", str(opts.min_match)),))]
    if use_suffix:
        lookups.append(ArmSpec("suffix", None, SUFFIX_IN_AUTO))
    # the short-match arm: in front of DFlash (measured there) and behind the suffix arm
    if opts.min_match > 1 and (model == "dflash" or (model is None and use_suffix)):
        lookups.append(ArmSpec("pld", None, (("min_ngram", "1"),)))
    if model is None:
        return lookups if use_suffix else [ArmSpec("pld")]
    return [*lookups, model_arm]


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
