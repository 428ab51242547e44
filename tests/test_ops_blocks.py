"""The attention and decoder-block twins (adaspec/kernels/blocks.py) give stock mlx-lm's bits."""

# isort: off
import adaspec  # noqa: F401  (BLAS and the JIT wrapper before mlx)
import sys
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

# isort: on
from adaspec.kernels import attention, blocks, layers

pytestmark = pytest.mark.skipif(
    not attention.enabled(), reason="the fast paths are off here (platform, ADASPEC_FAST_OPS)"
)

SPECIALS = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-41, 3e38, -3e38]


def same_bits(a: mx.array, b: mx.array) -> bool:
    """equal bits, except that a NaN may meet a NaN of another sign or payload (which NaN a
    multiply of two NaNs returns follows its operands' order: docs/fast_ops.md, "What
    differs"; the fast paths before these twins differ from stock mlx the same way)"""
    x, y = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    nan = np.isnan(x)
    if not (nan == np.isnan(y)).all():
        return False
    return bool((x[~nan].view(np.uint32) == y[~nan].view(np.uint32)).all())


def _args(arch: str, heads: int, kv_heads: int, head_dim: int, **extra):
    from mlx_lm.models import llama, qwen2

    common = dict(
        hidden_size=heads * head_dim,
        num_hidden_layers=1,
        intermediate_size=96,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=300,
        rope_theta=extra.pop("rope_theta", 10000.0),
        **extra,
    )
    module = {"llama": llama, "qwen2": qwen2}[arch]
    return module, module.ModelArgs(model_type=arch, **common)


def _pair(arch: str, heads: int, kv_heads: int, head_dim: int, seed: int, **extra):
    """(stock mlx-lm block, the same weights with every twin) and the mlx-lm module"""
    module, args = _args(arch, heads, kv_heads, head_dim, **extra)
    mx.random.seed(seed)
    ref, ours = module.TransformerBlock(args), module.TransformerBlock(args)
    params = [(k, v * 3 + 0.01) for k, v in tree_flatten(ref.parameters())]
    ref.load_weights(params)
    ours.load_weights(params)
    layers.install(ours)
    assert blocks.install(ours) == 2  # the block and its attention
    return module, ref, ours


@contextmanager
def _stock_sdpa(module):
    """mlx-lm's own attention function in `module` (the reference), then ours again"""
    from mlx_lm.models import base

    saved = module.scaled_dot_product_attention
    module.scaled_dot_product_attention = base.scaled_dot_product_attention
    try:
        yield
    finally:
        module.scaled_dot_product_attention = saved


@contextmanager
def _routed(module):
    saved = module.scaled_dot_product_attention
    module.scaled_dot_product_attention = attention.scaled_dot_product_attention
    try:
        yield
    finally:
        module.scaled_dot_product_attention = saved


def _short(attn, x, mask, cache) -> bool:
    """whether the attention twin takes a short path for this call (as its __call__ decides)"""
    if not blocks._decodes(attn, x, mask, cache):
        return False
    core = blocks._native(x)
    if core is None and not blocks._folds_in_ops(attn, x.shape[1], cache):
        return False
    return blocks._projects(attn, *blocks._project(attn, x, core))


NATIVE = attention._native


def _no_native(*_):
    return None


@contextmanager
def _natives(on: bool):
    """the native extension (kernels/native.py) where it is built, or mlx ops only"""
    attention._native = NATIVE if on else _no_native
    try:
        yield
    finally:
        attention._native = NATIVE


def _inputs(shape, seed: int, scale: float, specials: int) -> mx.array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * scale
    for i in range(specials):
        x.flat[rng.integers(x.size)] = SPECIALS[i % len(SPECIALS)]
    return mx.array(x)


def _caches(context: int, kv_heads: int, head_dim: int, seed: int, specials: int):
    """two KVCaches holding the same `context` random keys and values"""
    from mlx_lm.models.cache import KVCache

    out = []
    k = _inputs((1, kv_heads, context, head_dim), seed, 2.0, specials)
    v = _inputs((1, kv_heads, context, head_dim), seed + 1, 2.0, specials)
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(mx.array(k), mx.array(v))
        out.append(c)
    return out


@settings(deadline=None, max_examples=30)
@given(
    shape=st.sampled_from(
        [("llama", 9, 3, 64), ("qwen2", 14, 2, 64), ("llama", 4, 4, 32), ("qwen2", 8, 1, 16)]
    ),
    rows=st.sampled_from([1, 1, 2, 3, 8]),
    context=st.sampled_from([attention.MIN_SCORES, 200, 254, 256, 700]),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
    specials=st.sampled_from([0, 0, 3, 12]),
    seed=st.integers(0, 2**31 - 1),
    native=st.booleans(),
)
def test_decode_attention_equals_mlx_lm(
    shape, rows, context, scale, specials, seed, native
) -> None:
    """steps of 1 row (no mask) and verifies of 2-8 rows (the causal mask) through the twin,
    with the native extension and with mlx ops only, against stock mlx-lm (nn.Linear,
    nn.RoPE, mlx's sdpa): the outputs and the caches they leave, bit for bit, on inputs with
    +-0, +-inf, NaN, denormals and huge values"""
    with _natives(native):
        _decode_steps(shape, rows, context, scale, specials, seed)


def _decode_steps(shape, rows, context, scale, specials, seed) -> None:
    arch, heads, kv_heads, head_dim = shape
    rep = heads // kv_heads
    if rep * rows > 32:  # past the fold (blas.KERNEL_ROWS): mlx ops only with the native core
        rows = 32 // rep
    module, ref, ours = _pair(arch, heads, kv_heads, head_dim, seed)
    c_ref, c_ours = _caches(context, kv_heads, head_dim, seed, specials)
    mask = None if rows == 1 else "causal"
    for step in range(3):  # the cache grows past a 256-slot boundary at context 254, 256
        x = _inputs((1, rows, heads * head_dim), seed + step + 7, scale, specials)
        with _routed(module):
            assert _short(ours.self_attn, x, mask, c_ours)
            out = ours.self_attn(x, mask, c_ours)
        with _stock_sdpa(module):
            expected = ref.self_attn(x, mask, c_ref)
        assert same_bits(out, expected)
        assert c_ours.offset == c_ref.offset == context + (step + 1) * rows
        for a, b in zip(c_ours.state[:2], c_ref.state[:2], strict=True):
            assert same_bits(a[..., : c_ref.offset, :], b[..., : c_ref.offset, :])


def test_decode_attention_in_a_batch_of_two() -> None:
    from mlx_lm.models.cache import KVCache

    module, ref, ours = _pair("llama", 9, 3, 64, 5)
    caches = []
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(_inputs((2, 3, 300, 64), 1, 1.0, 0), _inputs((2, 3, 300, 64), 2, 1.0, 0))
        caches.append(c)
    x = _inputs((2, 1, 576), 3, 1.0, 4)
    with _routed(module):
        assert _short(ours.self_attn, x, None, caches[0])
        out = ours.self_attn(x, None, caches[0])
    with _stock_sdpa(module):
        assert same_bits(out, ref.self_attn(x, None, caches[1]))


@pytest.mark.parametrize("native", [True, False])
def test_several_rows_with_no_mask(native) -> None:
    """rows > 1 with no mask: the native path's attention_core (not attention_rows, which
    masks several rows), or sdpa's mlx ops"""
    module, ref, ours = _pair("llama", 9, 3, 64, 21)
    c_ref, c_ours = _caches(200, 3, 64, 8, 2)
    x = _inputs((1, 3, 576), 5, 1.0, 2)
    with _natives(native), _routed(module):
        assert _short(ours.self_attn, x, None, c_ours)
        out = ours.self_attn(x, None, c_ours)
    with _stock_sdpa(module):
        assert same_bits(out, ref.self_attn(x, None, c_ref))


def test_decode_attention_on_quantized_projections() -> None:
    """the twin changes nothing before or after the projections' own call: quantized
    projections with fp32 outputs take the short path with stock bits too"""
    import mlx.nn as nn

    module, ref, ours = _pair("qwen2", 14, 2, 64, 11)
    nn.quantize(ref, group_size=32, bits=4)
    nn.quantize(ours, group_size=32, bits=4)
    c_ref, c_ours = _caches(300, 2, 64, 4, 0)
    for rows in (1, 1, 2):
        x = _inputs((1, rows, 896), rows, 1.0, 2)
        mask = None if rows == 1 else "causal"
        with _routed(module):
            assert _short(ours.self_attn, x, mask, c_ours)
            out = ours.self_attn(x, mask, c_ours)
        with _stock_sdpa(module):
            assert same_bits(out, ref.self_attn(x, mask, c_ref))


@settings(deadline=None, max_examples=20)
@given(
    rows=st.sampled_from([1, 2, 3, 8, 32, 40]),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    specials=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fused_block_equals_mlx_lm(rows, scale, specials, seed) -> None:
    """the decoder block (residual sum and its square in one kernel) against stock mlx-lm, at
    rows the twin fuses (one kernel up to layers.RMS_ROWS, two up to RMS_MAX_ROWS) and
    beyond"""
    module, ref, ours = _pair("llama", 9, 3, 64, seed)
    c_ref, c_ours = _caches(180, 3, 64, seed, specials)
    x = _inputs((1, rows, 576), seed + 3, scale, specials)
    mask = None if rows == 1 else "causal"
    assert ours.post_attention_layernorm.fuses(x) == (rows <= layers.RMS_MAX_ROWS)
    with _routed(module):  # the block twice, as two layers: the second takes the kept square
        out = ours(ours(x, mask, c_ours), mask, c_ours)
    with _stock_sdpa(module):
        expected = ref(ref(x, mask, c_ref), mask, c_ref)
    assert same_bits(out, expected)


def test_a_kept_square_goes_to_that_array_once() -> None:
    x, y = mx.array([1.0, 2.0]), mx.array([1.0, 2.0])
    square = mx.square(x)
    layers.keep_square(x, square)
    assert layers.take_square(y) is None  # another array, though equal: nothing
    layers.keep_square(x, square)
    assert layers.take_square(x) is square
    assert layers.take_square(x) is None  # taken once


def test_angles_by_row_equal_the_angles() -> None:
    rope = layers.ExactRoPE(64, False, 10000.0, 1.0)
    for offset, n in [(0, 1), (200, 1), (199_999, 8), (5, 33)]:
        by_row = rope.cos_sin_by_row(offset, n)
        assert rope.cos_sin_by_row(offset, n) is by_row  # made once for every layer
        for a, b in zip(rope._cos_sin(offset, n), by_row, strict=True):
            assert b.shape == (n, 1, 32) and same_bits(a, b.reshape(n, 32))


def _fallback_cases():
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    return [
        ("rows past the fold", 20, KVCache, "causal", mx.float32),
        ("an array mask", 1, KVCache, "array", mx.float32),
        ("half precision", 1, KVCache, None, mx.float16),
        ("rotating cache", 1, RotatingKVCache, None, mx.float32),
        ("quantized cache", 1, QuantizedKVCache, None, mx.float32),
        ("too few scores", 1, KVCache, None, mx.float32),
    ]


@pytest.mark.parametrize("case", range(6))
def test_attention_falls_back_where_it_does_not_apply(case) -> None:
    """calls the short paths do not cover run mlx-lm's own code, with the same bits"""
    from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

    name, rows, cache_type, mask, dtype = _fallback_cases()[case]
    module, ref, ours = _pair("llama", 4, 2, 32, case)
    context = 20 if name == "too few scores" else 150
    kv = [_inputs((1, 2, context, 32), i, 1.0, 0).astype(dtype) for i in (1, 2)]
    caches = []
    for _ in range(2):
        if cache_type is RotatingKVCache:
            c = cache_type(max_size=512)
        else:
            c = cache_type(group_size=32) if cache_type is QuantizedKVCache else cache_type()
        c.update_and_fetch(mx.array(kv[0]), mx.array(kv[1]))
        caches.append(c)
    if dtype != mx.float32:
        ref.set_dtype(dtype)
        ours.set_dtype(dtype)
    x = _inputs((1, rows, 128), 9, 1.0, 0).astype(dtype)
    m = mx.ones((1, 1, rows, context + rows), mx.bool_) if mask == "array" else mask
    native = attention._native(x, x, None) is not None
    with _routed(module):  # the native extension covers these two where it is built
        covered = native and name in ("rows past the fold", "too few scores")
        assert _short(ours.self_attn, x, m, caches[0]) == covered, name
        out = ours.self_attn(x, m, caches[0])
    with _stock_sdpa(module):
        assert not _short(ours.self_attn, x, m, caches[1])  # mlx-lm's sdpa installed
        expected = ref.self_attn(x, m, caches[1])
    assert np.array_equal(np.array(out), np.array(expected), equal_nan=True), name
    if dtype == mx.float32:
        assert same_bits(out, expected), name


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_install_changes_classes_only_where_covered(arch) -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from tiny import tiny_model

    model, fresh = tiny_model(arch), tiny_model(arch)
    params = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    layers.install(model)
    changed = blocks.install(model)
    assert changed == (4 if arch == "llama" else 0)  # qwen3's attention is not covered
    assert blocks.install(model) == 0  # once only
    assert {k: np.array(v) for k, v in tree_flatten(model.parameters())}.keys() == params.keys()
    for k, v in tree_flatten(model.parameters()):
        assert same_bits(v, mx.array(params[k])), k
    tokens = mx.arange(160)[None] * 7 % 250
    c1, c2 = make_prompt_cache(model), make_prompt_cache(fresh)
    module = sys.modules[type(fresh).__module__]
    for chunk in (tokens[:, :150], *(tokens[:, i : i + 1] for i in range(150, 153))):
        with _routed(module):
            out = model(chunk, cache=c1)
        with _stock_sdpa(module):
            expected = fresh(chunk, cache=c2)
        assert same_bits(out, expected)
    assert blocks.uninstall(model) == changed
    assert all(type(m).__module__ != blocks.__name__ for _, m in model.named_modules())
