"""Drafters: the DraftModel protocol, built-in drafters and the registry."""

from .base import Draft, DraftContext, DraftModel, TargetInfo
from .registry import make, names, register

__all__ = ["Draft", "DraftContext", "DraftModel", "TargetInfo", "make", "names", "register"]
