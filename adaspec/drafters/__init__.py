"""Drafters: the DraftModel protocol, built-in drafters and the registry."""

from ..targets.base import TargetInfo
from .arms import DrafterPlan, make, make_arms, plan
from .base import Draft, DraftContext, DraftModel
from .registry import names, register

__all__ = [
    "Draft",
    "DraftContext",
    "DraftModel",
    "DrafterPlan",
    "TargetInfo",
    "make",
    "make_arms",
    "names",
    "plan",
    "register",
]
