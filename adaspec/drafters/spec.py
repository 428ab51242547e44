"""Drafter specs, the one little language for naming drafters, and its one parser.

    SPEC := ARM ("+" ARM)*          several arms: the policy picks one per step
    ARM  := NAME [":" [PATH] ("," KEY "=" VALUE)*]

PATH is the arm's positional argument (a checkpoint folder, a model name), the first part when
it is not KEY=VALUE; each drafter declares the keys it takes and their types.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import DrafterError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class ArmSpec:
    """One arm as written: its name, positional argument and raw KEY=VALUE pairs, in order."""

    name: str
    path: str | None = None
    options: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        parts = ([self.path] if self.path else []) + [f"{k}={v}" for k, v in self.options]
        return self.name + (":" + ",".join(parts) if parts else "")


@dataclass(frozen=True)
class DrafterArgs:
    """An arm's arguments after validation: `path` and typed `options`."""

    path: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any) -> Any:
        return self.options.get(key, default)


def split_arms(spec: str) -> list[ArmSpec]:
    """'pld+dflash:DIR,block=8' -> [ArmSpec('pld'), ArmSpec('dflash', 'DIR', (('block', '8'),))]."""
    if not isinstance(spec, str) or not spec.strip():
        raise DrafterError(f"drafter spec {spec!r} is empty; accepted: NAME[:ARG][+NAME[:ARG]...]")
    return [parse_arm(part, spec) for part in spec.split("+")]


def parse_arm(text: str, whole: str | None = None) -> ArmSpec:
    name, sep, rest = text.strip().partition(":")
    name = name.strip()
    if not name:
        raise DrafterError(
            f"drafter spec {whole or text!r} has an arm without a name; accepted: "
            "NAME[:ARG][+NAME[:ARG]...]"
        )
    parts = [p.strip() for p in rest.split(",")] if sep else []
    path = None
    if parts and "=" not in parts[0]:
        path = parts.pop(0) or None
    options = []
    for p in parts:
        key, eq, value = p.partition("=")
        if not eq or not key.strip():
            raise DrafterError(
                f"{name} argument {p!r} is invalid; accepted: KEY=VALUE after the first argument"
            )
        options.append((key.strip(), value.strip()))
    return ArmSpec(name, path, tuple(options))


_KINDS = {int: "an integer", float: "a number", bool: "a bool; accepted: 1/0, true/false"}


def _convert(name: str, key: str, value: str, kind: type) -> Any:
    if kind is bool and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    if kind is not bool:
        try:
            return kind(value)
        except ValueError:
            pass
    what = _KINDS.get(kind, f"a {kind.__name__}")
    raise DrafterError(f"{name} argument {key}={value!r} is not {what}")


def validate(arm: ArmSpec, options: Mapping[str, type], path: str | None) -> DrafterArgs:
    """Typed arguments of `arm`, against the keys and types the drafter declares; `path` says
    what its positional argument is (None: it takes none)."""
    if arm.path is not None and path is None:
        raise DrafterError(
            f"{arm.name} takes no positional argument, got {arm.path!r}; accepted: "
            + (", ".join(f"{k}=<{t.__name__}>" for k, t in options.items()) or "nothing")
        )
    out: dict[str, Any] = {}
    for key, value in arm.options:
        if key not in options:
            accepted = ", ".join(f"{k}=<{t.__name__}>" for k, t in options.items()) or "none"
            raise DrafterError(
                f"{arm.name} argument {key}={value!r} is invalid; accepted: {accepted}"
            )
        if key in out:
            raise DrafterError(f"{arm.name} argument {key} is given twice")
        out[key] = _convert(arm.name, key, value, options[key])
    return DrafterArgs(arm.path, out)


@dataclass(frozen=True)
class Entry:
    """How a drafter joins the registry: its factory(args, target_info, settings), the
    KEY=VALUE arguments it takes with their types, and what its positional argument is (None:
    it takes none). Built-in drafters and entry points name one as "module:ENTRY"."""

    factory: Callable[..., Any]
    options: Mapping[str, type] = field(default_factory=dict)
    path: str | None = "argument"

    def build(self, arm: ArmSpec, info: Any, settings: Any) -> Any:
        return self.factory(validate(arm, self.options, self.path), info, settings)
