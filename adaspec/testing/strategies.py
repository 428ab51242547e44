"""Hypothesis strategies for drafter tests: prompts, scripted step programs, probability rows,
token trees, and text over the tiny target's alphabet (needs `pip install adaspec[testing]`)."""

from __future__ import annotations

from hypothesis import strategies as st

# A step instruction for a scripted drafter: what kind of draft and how long. An "overlong"
# draft exceeds the budget and ends the generation (DrafterError), so it is drawn rarely.
LEGAL_MODES = ("oracle", "random", "corrupt", "empty")
mode = st.integers(0, 15).map(lambda i: "overlong" if i == 15 else LEGAL_MODES[i % 4])
step_program = st.lists(
    st.tuples(mode, st.integers(0, 12), st.integers(0, 1 << 30)),
    min_size=1,
    max_size=30,
)


def prompts(vocab: int, max_len: int = 24):
    return st.lists(st.integers(0, vocab - 1), min_size=1, max_size=max_len)


def prob_rows(v: int, rows: int):
    """(rows, v) strictly positive probability rows, as nested lists."""
    row = st.lists(st.floats(0.05, 1.0), min_size=v, max_size=v)
    return st.lists(row, min_size=rows, max_size=rows)


@st.composite
def token_trees(draw, vocab: int, max_nodes: int = 8, min_nodes: int = 0):
    """(tokens, parents) of a deterministic draft tree: parents before children (-1: the last
    committed token), distinct tokens among siblings."""
    n = draw(st.integers(min_nodes, max_nodes))
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(n):
        p = draw(st.integers(-1, i - 1))
        taken = {t for t, q in zip(tokens, parents) if q == p}
        free = [t for t in range(vocab) if t not in taken]
        if not free:
            break
        tokens.append(draw(st.sampled_from(free)))
        parents.append(p)
    return tokens, parents


# A step instruction for a tree drafter: what kind of tree, how many nodes, its seed.
tree_program = st.lists(
    st.tuples(
        st.sampled_from(("oracle", "corrupt", "random")),
        st.integers(0, 16),
        st.integers(0, 1 << 30),
    ),
    min_size=1,
    max_size=20,
)


def tiny_prompts(min_len: int = 1, max_len: int = 16):
    """Token ids of text over the tiny target's alphabet (adaspec.testing.target), <eos> left
    out; the target's greedy continuation of any of them is a repeated word."""
    from .target import ALPHABET

    return st.lists(st.integers(0, len(ALPHABET) - 1), min_size=min_len, max_size=max_len)
