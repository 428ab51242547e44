"""What the latest generation on a model measured, carried to the next one: per model (by id,
with a weak reference to it), per drafter spec and settings, the policy of its latest
generation. A new generation without a prompt cache starts from a copy of what that one
measured (the plain-step time, the arms' acceptance and costs: GatedPolicy.adopt) instead of
priors and a burst of plain steps timing decoding."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from ..settings import Settings
from .adaptive import GatedPolicy

_LATEST: dict[int, tuple[weakref.ref[Any], dict[tuple[str, str], GatedPolicy]]] = {}


def continued(model: Any, drafter: object, settings: Settings, policy: Any) -> Any:
    """`policy` (a new generation's), started from the latest GatedPolicy of a generation on
    `model` with the same drafter spec (a string) and settings; remembered as the latest."""
    if not isinstance(drafter, str) or not isinstance(policy, GatedPolicy):
        return policy
    key = (drafter, settings.model_dump_json())
    held = _LATEST.get(id(model))
    if held is None or held[0]() is not model:
        held = (weakref.ref(model, _forget(id(model))), {})
        _LATEST[id(model)] = held
    if key in held[1]:
        policy.adopt(held[1][key])
    held[1][key] = policy
    return policy


def _forget(key: int) -> Callable[[weakref.ref[Any]], None]:
    """Drops a model's entry when the model is freed (not a newer model's under the same id)."""

    def drop(ref: weakref.ref[Any]) -> None:
        if key in _LATEST and _LATEST[key][0] is ref:
            del _LATEST[key]

    return drop
