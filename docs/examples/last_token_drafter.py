"""A complete custom drafter: guess that the token after x is whatever followed x last time."""

import adaspec
from adaspec.drafters import Draft, DraftContext


class LastFollower:
    name = "last-follower"
    needs_taps: tuple[int, ...] = ()  # no target hidden states needed
    vocab_size = None  # only proposes ids it has seen

    def __init__(self, max_len: int = 4):
        self.max_len, self.tokens, self.next_of = max_len, [], {}

    def prefill(self, prompt_tokens: list[int], ctx: DraftContext) -> None:
        self.tokens, self.next_of = [], {}
        self.advance(prompt_tokens, ctx)

    def advance(self, committed_tokens: list[int], ctx: DraftContext) -> None:
        for t in committed_tokens:
            if self.tokens:
                self.next_of[self.tokens[-1]] = t
            self.tokens.append(t)

    def rollback(self, n: int) -> None:
        self.prefill(self.tokens[: len(self.tokens) - n], None)  # simple and exact: rebuild

    def draft(self, ctx: DraftContext) -> Draft:
        out, last = [], self.tokens[-1]
        while len(out) < min(self.max_len, ctx.max_draft) and last in self.next_of:
            last = self.next_of[last]
            out.append(last)
        return Draft(tuple(out))


def factory(args, target, settings):  # --drafter last-follower:max_len=6, or pld+last-follower
    return LastFollower(args.get("max_len", 4))


adaspec.register_drafter("last-follower", factory, options={"max_len": int}, path=None)
