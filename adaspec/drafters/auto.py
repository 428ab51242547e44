"""The "auto" drafter: prompt lookup when it finds a long enough match, a model drafter otherwise.

Registry spec: ``auto[:DIR][,min_match=N][,block=N][,window=N][,sink=N]`` -- the fallback is
DFlash from DIR (default: the checkpoint shipped for the target, if any); or
``auto:SPEC[,min_match=N]`` with SPEC any other registered drafter, e.g.
``auto:draft-model:qwen2.5-coder-0.5b``. PLD knobs come from settings.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..errors import DrafterError
from ..settings import Settings
from ..targets.base import TargetInfo
from . import dflash
from .base import Draft, DraftContext, DraftModel
from .pld import PromptLookup, parse_kv

log = logging.getLogger(__name__)

ARG_KEYS: dict[str, type] = {"min_match": int, **dflash.ARG_KEYS}


class AutoDrafter:
    """Both drafters see every prefill/advance/rollback, so either can draft at any step.
    PLD drafts are marked cheap, so the policy sizes them apart from the fallback's."""

    name = "auto"
    cheap_draft = False  # may fall through to the model drafter; peek() is the cheap part

    def __init__(self, pld: PromptLookup, fallback: DraftModel, min_match: int = 2):
        if min_match < 1:
            raise DrafterError(f"auto min_match={min_match} is invalid; accepted: >= 1")
        self.pld, self.fallback, self.min_match = pld, fallback, min_match
        self.needs_taps = fallback.needs_taps
        self.vocab_size = fallback.vocab_size
        self.used = {"pld": 0, fallback.name: 0}  # drafts proposed by each, for stats and tests
        self.last = ""  # which drafter made the latest draft

    def prefill(self, prompt_tokens: Sequence[int], ctx: DraftContext) -> None:
        self.pld.prefill(prompt_tokens, ctx)
        self.fallback.prefill(prompt_tokens, ctx)

    def draft(self, ctx: DraftContext) -> Draft:
        d = self.pld.draft(ctx)
        if len(d) and self.pld.last_match >= self.min_match:
            self.last = "pld"
        elif ctx.max_draft <= 0:  # only a cheap draft is wanted (the policy holds costly back)
            d, self.last = Draft(), ""
        else:
            d, self.last = self.fallback.draft(ctx), self.fallback.name
        if self.last:
            self.used[self.last] += len(d) > 0
        return d

    def peek(self, ctx: DraftContext) -> Draft:
        """While floored: PLD's draft alone (the model drafter is never run for a peek), so a
        strong prompt-lookup match can lift the floor as it does for the `pld` drafter."""
        return self.pld.draft(ctx)

    def advance(self, committed_tokens: Sequence[int], ctx: DraftContext) -> None:
        self.pld.advance(committed_tokens, ctx)
        self.fallback.advance(committed_tokens, ctx)

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self.pld.tokens):
            raise DrafterError(
                f"auto rollback({n}) out of range; accepted: 0..{len(self.pld.tokens)}"
            )
        self.pld.rollback(n)
        self.fallback.rollback(n)


def _fallback_spec(arg: str | None) -> str | None:
    """The fallback's spec when `arg` starts with a registered drafter's name ('draft-model:
    NAME,...'); None when it is a DFlash folder (or empty)."""
    from . import registry

    name = registry.parse_spec((arg or "").split(",")[0].strip())[0]
    if name not in registry.names():
        return None
    if name in ("auto", "pld"):
        raise DrafterError(
            f"auto:{arg} is invalid: PLD already comes first; accepted: auto[:DIR] (DFlash) or "
            "auto:SPEC with SPEC another drafter, e.g. auto:draft-model:NAME"
        )
    return arg


def factory(arg: str | None, info: TargetInfo, settings: Settings) -> AutoDrafter:
    from . import registry

    pld = PromptLookup(settings.pld_max_ngram, settings.pld_min_ngram, settings.pld_draft_len)
    spec = _fallback_spec(arg)
    if spec is not None:
        # the fallback's own k=v arguments pass through; min_match is ours
        parts = spec.split(",")
        ours = [p for p in parts[1:] if p.partition("=")[0].strip() == "min_match"]
        theirs = [parts[0]] + [p for p in parts[1:] if p not in ours]
        kw = parse_kv(",".join(ours), {"min_match": int}, "auto")
        fallback = registry.make(",".join(theirs), info, settings)
        assert fallback is not None  # "none" is not a registered name
        return AutoDrafter(pld, fallback, kw.get("min_match", settings.auto_pld_min_match))
    folder, kw = dflash.split_arg(arg, ARG_KEYS, "auto")
    dfl = dflash.load(
        dflash.checkpoint_dir(folder, info, "auto"),
        info,
        block=kw.get("block", settings.dflash_block),
        window=kw.get("window", settings.dflash_ctx_window),
        sink=kw.get("sink", settings.dflash_ctx_sink),
    )
    return AutoDrafter(pld, dfl, kw.get("min_match", settings.auto_pld_min_match))
