"""adaspec's own mlx primitive (kernels/native.py): attention in one graph node with stock
mlx's bits, and the graph of mlx ops wherever the extension cannot be built."""

# isort: off
import adaspec  # noqa: F401  (BLAS and the JIT wrapper before mlx)
import io
import platform
import re
import shutil

import mlx.core as mx
import numpy as np
import pytest

# isort: on
from adaspec.kernels import attention, blas, native
from adaspec.settings import from_env

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or not shutil.which("g++") or not blas.routed(),
    reason="the native primitive is built with g++ and runs on the routed kernel (Linux)",
)


def same_bits(a: mx.array, b: mx.array) -> bool:
    x, y = np.array(a), np.array(b)
    return x.shape == y.shape and bool((x.view(np.uint32) == y.view(np.uint32)).all())


def core():
    module = native.get()
    assert module is not None, native.status()
    return module


def qkv(seed, heads, kv_heads, q_len, k_len, dim=64, spare=0, scale=2.0):
    """q as attention layers hand it over ([B, L, H, D] transposed), K and V as a KV cache
    does (the first k_len rows of a longer buffer)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, q_len, heads, dim)).astype(np.float32) * scale
    k = rng.standard_normal((1, kv_heads, k_len + spare, dim)).astype(np.float32) * scale
    v = rng.standard_normal((1, kv_heads, k_len + spare, dim)).astype(np.float32)
    q = mx.array(q).transpose(0, 2, 1, 3)
    return q, mx.array(k)[:, :, :k_len], mx.array(v)[:, :, :k_len]


CASES = [  # heads, kv_heads, q_len, k_len, score scale: SmolLM2 9/3, Qwen 14/2, MHA, MQA
    (9, 3, 1, 1, 2.0),
    (9, 3, 1, 200, 2.0),
    (9, 3, 8, 200, 2.0),
    (9, 3, 11, 11, 2.0),  # as many keys as rows: a first chunk
    (9, 3, 24, 2048, 2.0),
    (14, 2, 3, 5000, 2.0),
    (14, 2, 16, 300, 2.0),  # 32 folded rows: the routed kernel's limit
    (14, 2, 20, 300, 2.0),  # 40 rows: one GEMM per query head
    (4, 4, 40, 100, 2.0),  # a prefill chunk past the routed kernel's rows
    (8, 1, 5, 77, 30.0),  # scores far apart: exp(x - max) below -88 gives 0
]


@pytest.mark.parametrize(("heads", "kv_heads", "q_len", "k_len", "scale"), CASES)
def test_attention_core_has_mlx_bits(heads, kv_heads, q_len, k_len, scale) -> None:
    q, k, v = qkv(q_len * 1000 + k_len, heads, kv_heads, q_len, k_len, spare=37, scale=scale)
    for mask in (None, "causal") if q_len > 1 else (None,):
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=64**-0.5, mask=mask)
        assert same_bits(attention.sdpa(q, k, v, scale=64**-0.5, mask=mask), ref)
        for fold in (False, True) if q_len * heads // kv_heads <= blas.KERNEL_ROWS else (False,):
            out = core().attention_core(q, k, v, 64**-0.5, mask == "causal", fold)
            assert same_bits(out, ref), (mask, fold)


def test_sdpa_is_one_graph_node() -> None:
    q, k, v = qkv(1, 9, 3, 4, 300)
    out = attention.sdpa(q, k, v, scale=0.125, mask="causal")
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    ops = re.findall(r'label ="([A-Za-z]+)', dot.getvalue())
    assert ops.count("AttentionCore") == 1 and "Matmul" not in ops and "Softmax" not in ops


def test_bad_shapes_are_refused_with_what_is_accepted() -> None:
    q, k, v = qkv(2, 9, 3, 4, 30)
    with pytest.raises(ValueError, match="Hq a multiple of Hk"):
        core().attention_core(q, k[:, :2], v[:, :2], 0.1, False, False)
    with pytest.raises(ValueError, match="rank 4"):
        core().attention_core(q[0], k, v, 0.1, False, False)
    with pytest.raises(ValueError, match="at least as many keys"):
        core().attention_core(*qkv(3, 9, 3, 8, 4), 0.1, True, False)


def test_without_a_compiler_attention_stays_mlx_ops(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(native, "_status", None)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native, "get_settings", lambda: from_env({"ADASPEC_CACHE": str(tmp_path)}))
    assert native.get() is None
    assert "could not run" in native.status().reason
    q, k, v = qkv(4, 9, 3, 8, 200)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    out = attention.sdpa(q, k, v, scale=0.125, mask="causal")
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    assert "AttentionCore" not in dot.getvalue() and same_bits(out, ref)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "rows", "contexts"),
    [
        (9, 3, [1, 1, 1, 1], [5, 200, 31, 2048]),  # four requests decoding
        (9, 3, [1, 8, 4, 1, 3], [40, 208, 60, 1, 9]),  # verifies and plain steps mixed
        (14, 2, [16, 2], [300, 5000]),  # 32 folded rows, then 4
        (9, 3, [11], [11]),  # one sequence, a first chunk
        (4, 4, [3, 40], [50, 100]),  # a prefill-sized sequence beside a verify
    ],
)
def test_attention_rows_gives_each_sequence_its_solo_bits(heads, kv_heads, rows, contexts):
    """Several sequences' query rows side by side, each with its own KV cache slice: every
    sequence's output rows are what sdpa (and mlx's fast SDPA) gives it alone."""
    seqs = [qkv(i * 7 + n, heads, kv_heads, n, s, spare=11) for i, (n, s) in enumerate(
        zip(rows, contexts))]  # fmt: skip
    q = mx.concatenate([s[0] for s in seqs], axis=2)
    rep = heads // kv_heads
    fold = [rep > 1 and attention._folds(rep * n, s[1]) for n, s in zip(rows, seqs)]
    out = core().attention_rows(q, [s[1] for s in seqs], [s[2] for s in seqs], rows, fold, 0.125)
    refs = []
    for n, (qi, ki, vi) in zip(rows, seqs):
        mask = "causal" if n > 1 else None
        ref = mx.fast.scaled_dot_product_attention(qi, ki, vi, scale=0.125, mask=mask)
        refs.append(ref.transpose(0, 2, 1, 3).reshape(1, n, -1))
    assert same_bits(out, mx.concatenate(refs, axis=1))


def test_attention_rows_refuses_rows_that_do_not_add_up():
    q, k, v = qkv(5, 9, 3, 4, 30)
    with pytest.raises(ValueError, match="add up"):
        core().attention_rows(q, [k, k], [v, v], [1, 2], [True, True], 0.1)
    with pytest.raises(ValueError, match="one key, value"):
        core().attention_rows(q, [k], [v, v], [4], [True], 0.1)


@pytest.mark.parametrize("rows", [1, 3, 8, 32, 40])
def test_linears_give_each_projection_its_bits(rows):
    """q/k/v (or gate/up) projections of one input in one node equal the Linear twin's and
    nn.Linear's outputs, with and without biases, past the routed kernel's rows too."""
    import mlx.nn as nn

    from adaspec.kernels import layers

    mx.random.seed(rows)
    stock = [nn.Linear(96, n, bias=b) for n, b in ((64, True), (32, False), (48, True))]
    twins = [layers._twin(m) for m in stock]
    x = mx.random.normal((1, rows, 96))
    outs = core().linears(x, [m.weight for m in stock], [m.get("bias") for m in stock])
    assert len(outs) == 3
    for out, m, t in zip(outs, stock, twins):
        assert same_bits(out, m(x)) and same_bits(out, t(x))
    with pytest.raises(ValueError, match="x's K"):
        core().linears(x, [mx.zeros((4, 95))], [None])
