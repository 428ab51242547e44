"""Tier 2/3: one forward over several sequences' rows (targets/batch.py) gives each sequence
the logits its solo forward gives, bit for bit, on tiny models and on SmolLM2: with attention
through mlx-lm's module per sequence (stock layers) and on the shared path (the native nodes
of kernels/native_layers.py, with the layer twins)."""

import io
import re
from contextlib import nullcontext
from unittest.mock import patch

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaspec.errors import TargetError
from adaspec.kernels import blas, layers, native
from adaspec.targets import batch, make_target
from adaspec.targets.batch import MAX_ROWS, batch_unsupported, forward_rows, shared_unsupported


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def twins(request):
    """A tiny model with the RoPE / RMSNorm / Linear twins: its batched forwards take the
    shared attention path"""
    from tiny import tiny_model

    model = tiny_model(request.param, seed=5)
    layers.install(model)
    return model


def _same_as_solo(
    model, vocab: int, seed: int, n: int, steps: int, taps=(), context: int = 40
) -> None:
    rng = np.random.default_rng(seed)
    solo = [make_target(model) for _ in range(n)]
    bat = [make_target(model) for _ in range(n)]
    for a, b in zip(solo, bat):
        p = rng.integers(0, vocab, int(rng.integers(2, context))).tolist()
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


@given(seed=st.integers(0, 2**16), n=st.integers(1, 6), split=st.booleans())
def test_batched_rows_equal_solo_forwards_bit_for_bit(tiny, seed, n, split):
    """on whichever path the target takes, and with attention forced through mlx-lm's
    module per sequence"""
    assert batch_unsupported(make_target(tiny)) == ""
    with patch.object(batch, "shared_unsupported", lambda *_: "split") if split else nullcontext():
        _same_as_solo(tiny, 256, seed, n, steps=3)


@given(seed=st.integers(0, 2**16), n=st.integers(1, 8))
def test_shared_attention_rows_equal_solo_forwards_bit_for_bit(twins, seed, n):
    """contexts up to 300 keys (both softmax sizes), up to 32 rows for one sequence (a query
    wider than the routed kernel's rows: that sequence runs the module's own attention)"""
    if not blas.routed():
        pytest.skip("the shared path needs the routed GEMM kernel")
    assert shared_unsupported(twins, [make_target(twins)]) == ""
    _same_as_solo(twins, 256, seed, n, steps=3, context=300)


def test_shared_path_names_why_it_is_not_taken(twins):
    """stock layers, a non-fp32 projection: mlx-lm's attention per sequence, and why"""
    from tiny import tiny_model

    from adaspec.targets.kv import KVTarget

    stock = tiny_model("llama")  # KVTarget itself installs no twins (make_target does)
    assert "RoPE RoPE (accepted: ExactRoPE" in shared_unsupported(stock, [KVTarget(stock)])
    proj = twins.layers[0].self_attn.q_proj
    weight = proj.weight
    try:
        proj.weight = weight.astype(mx.float16)
        why = shared_unsupported(twins, [make_target(twins)])
    finally:
        proj.weight = weight
    assert why == "layer 0: q_proj computes in mlx.core.float16 (accepted: float32)"


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


def _nodes(model, n: int, rows: int) -> int:
    ts = [make_target(model) for _ in range(n)]
    for i, t in enumerate(ts):
        t.prefill(list(range(1, 30 + 3 * i)))
    got = forward_rows(ts, [[7] * rows for _ in ts])
    buf = io.StringIO()
    mx.export_to_dot(buf, *[f.logits for f in got])
    return len(re.findall(r'label ="[A-Za-z]+', buf.getvalue()))


@pytest.mark.parametrize("rows", [1, 3])
def test_shared_attention_adds_few_graph_nodes_per_sequence(rows, monkeypatch):
    """mlx schedules every graph node for microseconds whatever it computes: a sequence
    joining the forward adds little more than its cache update and attention core per
    layer, well under half of what an attention through mlx-lm's module costs"""
    from tiny import tiny_model

    if not blas.routed() or native.get() is None:
        pytest.skip("the shared path is the native extension's, on the routed GEMM kernel")
    model = tiny_model("llama", layers=8)
    layers.install(model)
    monkeypatch.setattr(batch, "EVAL_EACH_LAYER", False)  # one lazy graph to count
    # 4 and 8 sequences: both past the RMSNorm twin's row limit, so only attention differs
    shared = [_nodes(model, n, rows) for n in (4, 8)]
    monkeypatch.setattr(batch, "shared_unsupported", lambda *_: "split")
    split = [_nodes(model, n, rows) for n in (4, 8)]
    # the whole forward's graph was counted: a node per layer at least (the decoder layer)
    assert shared[0] > len(model.layers), shared
    per = 4 * len(model.layers)
    shared_added, split_added = (shared[1] - shared[0]) / per, (split[1] - split[0]) / per
    # a sequence adds no node per layer (0.9 measured: the forward's own per-sequence nodes
    # spread over the layers), against 38.8 (1 row) and 38.7 (3 rows) through mlx-lm's module
    assert shared_added <= 2, (shared_added, split_added)
    assert shared_added <= 0.4 * split_added, (shared_added, split_added)


@pytest.mark.slow
def test_smollm2_batched_rows_equal_solo_forwards(smollm2):
    model, _ = smollm2
    if blas.routed():
        assert shared_unsupported(model, [make_target(model)]) == ""
    _same_as_solo(model, 49152, 3, 6, steps=4, context=300)
