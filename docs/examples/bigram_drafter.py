"""A complete drafter: after token x, guess what followed x the last time it appeared."""

import adaspec
from adaspec.drafters import Draft


class Bigram:
    name, needs_taps, vocab_size = "bigram", (), None  # no hidden states; copies seen ids

    def prefill(self, prompt_tokens, ctx):
        self.tokens = list(prompt_tokens)

    def advance(self, committed_tokens, ctx):
        self.tokens += committed_tokens

    def rollback(self, n):
        del self.tokens[len(self.tokens) - n :]

    def draft(self, ctx):
        follows = dict(zip(self.tokens, self.tokens[1:]))  # x -> what followed x last
        out, last = [], self.tokens[-1]
        while len(out) < min(ctx.max_draft, 8) and last in follows:
            last = follows[last]
            out.append(last)
        return Draft(out)


def factory(args, target, settings):  # args: the spec's validated arguments (none here)
    return Bigram()


adaspec.register_drafter("bigram", factory, path=None)
