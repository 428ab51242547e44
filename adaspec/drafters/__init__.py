"""Drafters: the DraftModel protocol, built-in drafters and the registry."""

from ..targets.base import TargetInfo
from .base import Draft, DraftContext, DraftModel
from .plan import DrafterPlan, make, make_arms, plan
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
