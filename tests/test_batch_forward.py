"""Tier 2/3: one forward over several sequences' rows (targets/batch.py) gives each sequence
the logits its solo forward gives, bit for bit, on tiny models and on SmolLM2."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaspec.errors import TargetError
from adaspec.targets import make_target
from adaspec.targets.batch import MAX_ROWS, batch_unsupported, forward_rows


def _same_as_solo(model, vocab: int, seed: int, n: int, steps: int, taps=()) -> None:
    rng = np.random.default_rng(seed)
    solo = [make_target(model) for _ in range(n)]
    bat = [make_target(model) for _ in range(n)]
    for a, b in zip(solo, bat):
        p = rng.integers(0, vocab, int(rng.integers(2, 40))).tolist()
        a.prefill(p, taps)
        b.prefill(p, taps)
    for _ in range(steps):
        per = max(1, MAX_ROWS // n)
        rows = [rng.integers(0, vocab, int(rng.integers(1, per + 1))).tolist() for _ in range(n)]
        got = forward_rows(bat, rows, taps)
        for t, r, f in zip(solo, rows, got):
            want = t.forward(r, taps)
            assert mx.array_equal(want.logits, f.logits).item()
            if taps:
                assert mx.array_equal(want.features, f.features).item()
        assert [t.offset for t in solo] == [t.offset for t in bat]
        # a random sequence takes back some of what it was fed, as a rejected draft would
        i = int(rng.integers(n))
        k = int(rng.integers(0, len(rows[i]) + 1))
        solo[i].rollback(k)
        bat[i].rollback(k)


@given(seed=st.integers(0, 2**16), n=st.integers(1, 6))
def test_batched_rows_equal_solo_forwards_bit_for_bit(tiny, seed, n):
    assert batch_unsupported(make_target(tiny)) == ""
    _same_as_solo(tiny, 256, seed, n, steps=3)


def test_taps_are_split_per_sequence(tiny):
    _same_as_solo(tiny, 256, 7, 3, steps=2, taps=(0, 1))


def test_too_many_rows_or_mismatched_lists_are_refused(tiny):
    t = [make_target(tiny), make_target(tiny)]
    for x in t:
        x.prefill([1, 2, 3])
    with pytest.raises(TargetError, match=f"at most {MAX_ROWS}"):
        forward_rows(t, [[1] * MAX_ROWS, [2]])
    with pytest.raises(TargetError, match="one non-empty row list per target"):
        forward_rows(t, [[1]])
    with pytest.raises(TargetError, match="each fed >= 1 row"):
        forward_rows(t, [[1], []])


@pytest.mark.slow
def test_smollm2_batched_rows_equal_solo_forwards(smollm2):
    model, _ = smollm2
    _same_as_solo(model, 49152, 3, 6, steps=4)
