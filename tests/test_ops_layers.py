"""The RoPE and RMSNorm twins (adaspec/kernels/layers.py) give stock mlx's bits."""

# isort: off
import adaspec  # noqa: F401  (BLAS and the JIT wrapper before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx.utils import tree_flatten

# isort: on
from adaspec.kernels import fast_ops, layers


def same_bits(a: mx.array, b: mx.array) -> bool:
    x, y = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return (
        x.shape == y.shape
        and x.dtype == y.dtype
        and bool((x.view(np.uint8) == y.view(np.uint8)).all())
    )


@given(
    dims_of=st.sampled_from([(64, 64), (128, 128), (32, 64), (16, 80)]),
    base=st.sampled_from([10000.0, 100000.0, 1000000.0, 500.5]),
    scale=st.sampled_from([1.0, 0.5, 0.25]),
    offset=st.one_of(st.integers(0, 300), st.integers(0, 200_000)),
    rows=st.integers(1, 40),
    heads=st.sampled_from([1, 3, 9]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rope_equals_mlx_rope(dims_of, base, scale, offset, rows, heads, seed) -> None:
    dims, head_dim = dims_of
    x = mx.random.normal((1, heads, rows, head_dim), key=mx.random.key(seed)) * 4
    ref = nn.RoPE(dims, base=base, scale=scale)(x, offset=offset)
    assert same_bits(layers.ExactRoPE(dims, False, base, scale)(x, offset=offset), ref)


@pytest.mark.parametrize(
    ("traditional", "offset", "dtype"),
    [(True, 7, mx.float32), (False, "array", mx.float32), (False, 7, mx.float16)],
)
def test_rope_falls_back_where_it_does_not_apply(traditional, offset, dtype) -> None:
    x = (mx.random.normal((2, 4, 5, 64)) * 3).astype(dtype)
    off = mx.array([3, 9]) if offset == "array" else offset
    ref = nn.RoPE(64, traditional=traditional, base=10000.0)(x, offset=off)
    out = layers.ExactRoPE(64, traditional, 10000.0, 1.0)(x, offset=off)
    assert same_bits(out, ref)


def test_rope_angles_are_shared_by_calls_at_one_position() -> None:
    rope, other = layers.ExactRoPE(64, False, 10000.0, 1.0), layers.ExactRoPE(64, False, 1e4)
    a = rope._cos_sin(200, 8)
    assert rope._cos_sin(200, 8) is a and rope._cos_sin(201, 8) is not a
    assert other._cos_sin(200, 8) is a  # every layer's twin: one computation per step
    assert layers.ExactRoPE(64, False, 500.0)._cos_sin(200, 8) is not a
    assert layers.ExactRoPE(32, False, 1e4)._cos_sin(200, 8) is not a
    for i in range(layers._ANGLES + 1):
        rope._cos_sin(1000 + i, 1)
    assert (64, 1e4, 1.0, 200, 8) not in layers._SHARED and len(layers._SHARED) == layers._ANGLES


SPECIAL = st.sampled_from([0.0, -0.0, float("inf"), float("nan"), 1e-40, 3e38, -3e38])


@given(
    dims=st.sampled_from([8, 64, 576, 896]),
    rows=st.one_of(st.integers(1, layers.RMS_ROWS), st.integers(1, layers.RMS_MAX_ROWS + 8)),
    eps=st.sampled_from([1e-5, 1e-6, 1e-3]),
    scale=st.sampled_from([1e-3, 1.0, 100.0]),
    seed=st.integers(0, 2**31 - 1),
    special=st.lists(st.tuples(st.integers(0, 10**6), SPECIAL), max_size=3),
)
def test_rms_norm_equals_mlx_rms_norm(dims, rows, eps, scale, seed, special) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, rows, dims)).astype(np.float32) * scale
    for pos, value in special:
        x.flat[pos % x.size] = value
    norm = nn.RMSNorm(dims, eps=eps)
    norm.weight = mx.array(rng.standard_normal(dims).astype(np.float32))
    twin = layers._twin(norm)
    assert same_bits(twin(mx.array(x)), norm(mx.array(x)))


def test_rms_norm_in_half_precision_falls_back() -> None:
    norm = nn.RMSNorm(64)
    norm.set_dtype(mx.float16)
    x = mx.random.normal((1, 3, 64)).astype(mx.float16)
    assert same_bits(layers._twin(norm)(x), norm(x))


@given(
    rows=st.integers(1, 40),
    batch=st.sampled_from([1, 2]),
    shape=st.sampled_from([(64, 96), (576, 192), (192, 576), (576, 1536)]),
    bias=st.booleans(),
    layout=st.sampled_from(["3d", "2d", "strided"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_equals_mlx_linear(rows, batch, shape, bias, layout, seed) -> None:
    k_in, n_out = shape
    key = mx.random.key(seed)
    lin = nn.Linear(k_in, n_out, bias=bias)
    lin.weight = mx.random.normal((n_out, k_in), key=key) * 0.5
    if bias:
        lin.bias = mx.random.normal((n_out,), key=mx.random.key(seed + 1))
    x = mx.random.normal((batch, rows, 2 * k_in), key=mx.random.key(seed + 2)) * 3
    x = {"3d": x[..., :k_in], "2d": x[0, :, :k_in], "strided": x[..., ::2]}[layout]
    if layout == "3d":
        x = mx.contiguous(x)
    twin = layers._twin(lin)
    assert type(twin) is layers.ExactLinear and twin.weight is lin.weight
    for _ in range(2):  # the transposed weight made, then reused
        assert same_bits(twin(x), lin(x))
    lin.weight = twin.weight = lin.weight * 2  # a new weight is transposed anew
    assert same_bits(twin(x), lin(x))


def test_linear_in_half_precision_and_under_grad() -> None:
    lin = nn.Linear(64, 32)
    twin = layers._twin(lin)
    x = mx.random.normal((1, 3, 64))
    for dtype in (mx.float16, mx.bfloat16):
        assert same_bits(twin(x.astype(dtype)), lin(x.astype(dtype)))
    loss = lambda m, v: (m(v) ** 2).sum()  # noqa: E731
    g_twin = nn.value_and_grad(twin, loss)(twin, x)[1]
    g_ref = nn.value_and_grad(lin, loss)(lin, x)[1]
    for (k, a), (_, b) in zip(tree_flatten(g_twin), tree_flatten(g_ref), strict=True):
        assert same_bits(a, b), k


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_install_swaps_instances_and_keeps_logits(arch) -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from tiny import tiny_model

    model, fresh = tiny_model(arch), tiny_model(arch)
    params = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    tokens = mx.array([[5, 17, 99, 3, 42, 7, 8, 250, 1, 2, 3]])
    n_norms = sum(type(m) is nn.RMSNorm for _, m in model.named_modules())
    n_linear = sum(type(m) is nn.Linear for _, m in model.named_modules())
    assert layers.install(model) == n_norms + 2 + n_linear  # norms, both layers' RoPE, linears
    assert layers.install(model) == 0  # once only
    kinds = (nn.RMSNorm, nn.RoPE, nn.Linear)
    assert not any(type(m) in kinds for _, m in model.named_modules())
    assert {k for k, _ in tree_flatten(model.parameters())} == set(params)
    c1, c2 = make_prompt_cache(model), make_prompt_cache(fresh)
    for chunk in (tokens[:, :9], tokens[:, 9:10], tokens[:, 10:]):  # prefill, then steps
        assert same_bits(model(chunk, cache=c1), fresh(chunk, cache=c2))


@pytest.mark.slow
@pytest.mark.parametrize("context", [200, 2000])
def test_real_model_logits_equal_stock_mlx(smollm2, context) -> None:
    """SmolLM2 (weights as the loader gives them: stored bits where the router runs) with
    every fast path against the same weights with them taken off (fast_ops.uninstall: stock
    mlx-lm modules and names): the prefill, a 1-row step at a new position and an 8-row
    verify, bit for bit."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    model, _ = smollm2
    done = fast_ops.install(model)
    tokens = mx.arange(context + 9)[None] * 7 % 900 + 10

    def logits() -> list[np.ndarray]:
        cache = make_prompt_cache(model)
        out = [np.array(model(tokens[:, :context], cache=cache)[:, -4:])]
        for n in (1, 1, 8):  # steps at two positions, then a verify
            out.append(np.array(model(tokens[:, cache[0].offset :][:, :n], cache=cache)))
        trim_prompt_cache(cache, 8)
        return out

    ours = logits()
    try:
        off = fast_ops.uninstall(model)
        # a layer's 7 linears, 2 norms and RoPE; the last norm
        assert off.layers == 30 * 10 + 1
        if fast_ops.attention.enabled():
            assert off.attention_modules and off.generate_logsumexp
        stock = logits()
    finally:
        fast_ops.install(model)  # the session's model keeps its fast paths
    assert fast_ops.install(model).layers == 0
    assert done.layers in (0, 30 * 10 + 1)
    for a, b in zip(ours, stock, strict=True):
        assert a.shape == b.shape and (a.view(np.uint32) == b.view(np.uint32)).all()
