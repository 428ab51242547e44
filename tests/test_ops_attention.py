"""Attention in one native node (adaspec/kernels/attention.py) and the vectorized logsumexp
(kernels/softmax.py) give stock mlx's bits."""

# isort: off
import adaspec  # noqa: F401  (BLAS and the JIT wrapper before mlx)
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

# isort: on
from adaspec.kernels import attention, softmax


def same_bits(a: mx.array, b: mx.array) -> bool:
    x, y = np.array(a), np.array(b)
    return x.shape == y.shape and bool((x.view(np.uint32) == y.view(np.uint32)).all())


SPECIAL = st.sampled_from([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3e38])


@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 300),
    scale=st.sampled_from([1e-3, 1.0, 10.0, 100.0]),
    seed=st.integers(0, 2**31 - 1),
    special=st.lists(st.tuples(st.integers(0, 10**6), SPECIAL), max_size=4),
)
def test_logsumexp_equals_mlx_bit_for_bit(rows, cols, scale, seed, special) -> None:
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * scale
    for pos, value in special:
        x.flat[pos % x.size] = value
    s = mx.array(x)
    assert same_bits(softmax.logsumexp(s), mx.logsumexp(s, axis=-1, keepdims=True))


def test_logsumexp_over_a_vocabulary() -> None:
    """the shape the policy uses: a few rows of logits over a 49,152-token vocabulary"""
    logits = mx.random.normal((1, 16, 49152), key=mx.random.key(3)) * 8
    ref = mx.logsumexp(logits, axis=-1, keepdims=True)
    assert same_bits(softmax.logsumexp(logits), ref)
    assert same_bits(softmax.fast_logsumexp(logits), ref)
    half = logits.astype(mx.float16)
    out, ref16 = softmax.fast_logsumexp(half), mx.logsumexp(half, axis=-1, keepdims=True)
    assert np.array_equal(np.array(out).view(np.uint16), np.array(ref16).view(np.uint16))


def test_logsumexp_of_masked_rows() -> None:
    x = mx.full((3, 50), mx.finfo(mx.float32).min)  # every position masked by `where`
    x[1, :3] = mx.array([1.0, 2.0, 3.0])
    x[2] = -float("inf")  # an additive -inf mask over a whole row
    assert same_bits(softmax.logsumexp(x), mx.logsumexp(x, axis=-1, keepdims=True))


def _qkv(batch, heads, kv_heads, q_len, k_len, seed, dim=64):
    k0, k1, k2 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((batch, heads, q_len, dim), key=k0)
    k = mx.random.normal((batch, kv_heads, k_len, dim), key=k1)
    v = mx.random.normal((batch, kv_heads, k_len, dim), key=k2)
    return q, k, v


def _mask(kind, batch, heads, q_len, k_len, seed):
    rng = np.random.default_rng(seed)
    if kind in (None, "causal"):
        return kind
    keep = rng.random((batch, heads, q_len, k_len)) < 0.8
    keep[..., 0] = True
    if kind == "bool":
        return mx.array(keep)
    if kind == "bool-2d":
        return mx.array(keep[0, 0])
    additive = np.where(keep, rng.standard_normal(keep.shape), -np.inf).astype(np.float32)
    return mx.array(additive[:, :1])  # one mask for every head, broadcast


SHAPES = [  # (heads, kv_heads, q_len, k_len): SmolLM2 (9/3), Qwen2.5-0.5B (14/2), MHA, MQA
    (9, 3, 1, 200),
    (9, 3, 8, 208),
    (9, 3, 16, 2016),
    (9, 3, 32, 232),
    (14, 2, 5, 1000),
    (14, 2, 1, 8192),
    (14, 2, 4, 1000),
    (9, 3, 8, 2016),
    (4, 4, 16, 16),
    (8, 1, 3, 77),
]


def _native_node(out: mx.array) -> bool:
    import io

    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    return "AttentionCore" in dot.getvalue()


NATIVE = attention.native_core(*_qkv(1, 2, 1, 1, 1, 0), None) is not None


@pytest.mark.parametrize(("heads", "kv_heads", "q_len", "k_len"), SHAPES)
@pytest.mark.parametrize("mask", [None, "causal", "bool", "bool-2d", "additive"])
def test_sdpa_equals_mlx_fast_sdpa_bit_for_bit(heads, kv_heads, q_len, k_len, mask) -> None:
    batch = 2 if k_len < 1000 else 1
    q, k, v = _qkv(batch, heads, kv_heads, q_len, k_len, seed=q_len * k_len + heads)
    m = _mask(mask, batch, heads, q_len, k_len, seed=k_len)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=64**-0.5, mask=m)
    out = attention.sdpa(q, k, v, scale=64**-0.5, mask=m)
    assert _native_node(out) == NATIVE  # every mask in one node where the extension runs
    assert same_bits(out, ref)


@pytest.mark.parametrize(("heads", "kv_heads", "q_len", "k_len"), [(9, 3, 1, 2000), (9, 3, 8, 200)])
def test_sdpa_on_a_cache_slice_equals_mlx(heads, kv_heads, q_len, k_len) -> None:
    # keys and values as a KV cache hands them over: the first k_len rows of a longer buffer
    q, k, v = _qkv(1, heads, kv_heads, q_len, k_len + 256, seed=k_len)
    k, v = k[:, :, :k_len], v[:, :, :k_len]
    for m in (None, "causal"):
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=64**-0.5, mask=m)
        assert same_bits(attention.sdpa(q, k, v, scale=64**-0.5, mask=m), ref)


def test_mlx_lm_entry_point_falls_back_where_it_does_not_apply() -> None:
    """calls the native node does not take run mlx's own attention: half precision, other
    mask kinds, attention sinks"""
    q, k, v = _qkv(1, 4, 2, 3, 10, seed=1)
    half = [a.astype(mx.float16) for a in (q, k, v)]
    assert attention.native_core(*half, None) is None
    assert attention.native_core(q, k, v, "sliding") is None
    assert attention.native_core(q, k[:, :, :2], v[:, :, :2], "causal") is None  # keys < rows
    sinks = mx.zeros((4,))
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask="causal", sinks=sinks)
    out = attention.scaled_dot_product_attention(q, k, v, None, 0.1, "causal", sinks)
    assert not _native_node(out) and same_bits(out, ref)
    ref16 = mx.fast.scaled_dot_product_attention(*half, scale=0.1, mask=None)
    out16 = attention.scaled_dot_product_attention(*half, None, 0.1, None)
    assert np.array_equal(np.array(out16), np.array(ref16))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_install_routes_a_model_and_uninstall_gives_the_name_back(arch) -> None:
    import sys

    from mlx_lm.models import base
    from tiny import tiny_model

    model = tiny_model(arch)
    module = sys.modules[type(model).__module__]
    routed = {
        n: vars(sys.modules[n])["scaled_dot_product_attention"] for n in attention.installed()
    }
    tokens = mx.arange(40)[None] * 7 % 250
    attention.uninstall()  # as if never routed
    ref = model(tokens)
    try:
        changed = attention.install(model)
        if not attention.enabled():
            assert changed == []
            pytest.skip("the fast path is off here (not Linux x86-64 CPU, or ADASPEC_FAST_OPS)")
        assert changed == [module.__name__] and attention.installed() == changed
        assert module.scaled_dot_product_attention is attention.scaled_dot_product_attention
        assert same_bits(model(tokens), ref)
        assert attention.install(model) == []  # once only
        assert attention.uninstall() == changed and attention.installed() == []
        assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
    finally:  # what earlier tests routed stays routed
        for name, fn in routed.items():
            vars(sys.modules[name])["scaled_dot_product_attention"] = fn
        attention._installed[:] = list(routed)
