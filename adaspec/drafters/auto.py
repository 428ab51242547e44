"""The "auto" drafter: prompt lookup when it finds a long enough match, DFlash otherwise.

Registry spec: ``auto[:DIR][,min_match=N][,block=N][,window=N][,sink=N]`` -- DIR is the DFlash
checkpoint (default: the one shipped for the target, if any); PLD knobs come from settings.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..errors import DrafterError
from ..settings import Settings
from . import dflash
from .base import Draft, DraftContext, TargetInfo
from .pld import PromptLookup

log = logging.getLogger(__name__)

ARG_KEYS: dict[str, type] = {"min_match": int, **dflash.ARG_KEYS}


class AutoDrafter:
    """Both drafters see every prefill/advance/rollback, so either can draft at any step."""

    name = "auto"
    cheap_draft = False  # may fall through to DFlash

    def __init__(self, pld: PromptLookup, dfl: dflash.DFlashDrafter, min_match: int = 2):
        if min_match < 1:
            raise DrafterError(f"auto min_match={min_match} is invalid; accepted: >= 1")
        self.pld, self.dflash, self.min_match = pld, dfl, min_match
        self.needs_taps = dfl.needs_taps
        self.vocab_size = dfl.vocab_size
        self.used = {"pld": 0, "dflash": 0}  # drafts proposed by each, for stats and tests
        self.last = ""  # which drafter made the latest draft

    def prefill(self, prompt_tokens: Sequence[int], ctx: DraftContext) -> None:
        self.pld.prefill(prompt_tokens, ctx)
        self.dflash.prefill(prompt_tokens, ctx)

    def draft(self, ctx: DraftContext) -> Draft:
        d = self.pld.draft(ctx)
        if len(d) and self.pld.last_match >= self.min_match:
            self.last = "pld"
        else:
            d, self.last = self.dflash.draft(ctx), "dflash"
        self.used[self.last] += len(d) > 0
        return d

    def advance(self, committed_tokens: Sequence[int], ctx: DraftContext) -> None:
        self.pld.advance(committed_tokens, ctx)
        self.dflash.advance(committed_tokens, ctx)

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self.dflash.tokens):
            raise DrafterError(
                f"auto rollback({n}) out of range; accepted: 0..{len(self.dflash.tokens)}"
            )
        self.pld.rollback(n)
        self.dflash.rollback(n)


def factory(arg: str | None, info: TargetInfo, settings: Settings) -> AutoDrafter:
    folder, kw = dflash.split_arg(arg, ARG_KEYS, "auto")
    dfl = dflash.load(
        dflash.checkpoint_dir(folder, info, "auto"),
        info,
        block=kw.get("block", settings.dflash_block),
        window=kw.get("window", settings.dflash_ctx_window),
        sink=kw.get("sink", settings.dflash_ctx_sink),
    )
    pld = PromptLookup(settings.pld_max_ngram, settings.pld_min_ngram, settings.pld_draft_len)
    return AutoDrafter(pld, dfl, kw.get("min_match", settings.auto_pld_min_match))
