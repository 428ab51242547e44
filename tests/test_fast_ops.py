"""The fast paths go on by one explicit call and come off by another (kernels/fast_ops.py):
install changes the model it is given and mlx-lm's names, uninstall gives back mlx-lm's own
classes, modules and names, and nothing else in adaspec changes them (make_target runs a model
as it is). Where the native nodes do not apply, mlx-lm's own code runs, with the same bits."""

# isort: off
import adaspec  # noqa: F401  (BLAS and the JIT wrapper before mlx)
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

# isort: on
from adaspec.kernels import attention, fast_ops, native

pytestmark = pytest.mark.skipif(
    not attention.enabled(), reason="the fast paths are off here (ADASPEC_FAST_OPS, platform)"
)

ARCH_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


def same_bits(a: mx.array, b: mx.array) -> bool:
    x, y = np.array(a), np.array(b)
    return x.shape == y.shape and bool((x.view(np.uint32) == y.view(np.uint32)).all())


@pytest.fixture
def stock_names():
    """mlx-lm's own names for the test (whatever earlier tests installed), restored after"""
    import mlx_lm.generate  # noqa: F401
    from mlx_lm.models import llama, qwen2, qwen3  # noqa: F401

    modules = [sys.modules[n] for n in ARCH_MODULES]
    gen = sys.modules["mlx_lm.generate"]
    saved = (
        [vars(m)["scaled_dot_product_attention"] for m in modules],
        gen.mx,
        [*attention._installed],
    )
    fast_ops.uninstall()
    yield
    for m, fn in zip(modules, saved[0]):
        vars(m)["scaled_dot_product_attention"] = fn
    vars(gen)["mx"] = saved[1]
    attention._installed[:] = saved[2]


def _classes(model) -> list[tuple[str, type]]:
    return [(name, type(m)) for name, m in model.named_modules()]


def _steps(model, tokens, cache_maker=None) -> list[mx.array]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = cache_maker(model) if cache_maker else make_prompt_cache(model)
    out = [model(tokens[:, :9], cache=cache)]
    for i in range(9, tokens.shape[1]):
        out.append(model(tokens[:, i : i + 1], cache=cache))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_install_then_uninstall_restores_mlx_lm(arch, stock_names) -> None:
    from mlx_lm.models import base
    from tiny import tiny_model

    model = tiny_model(arch)
    module = sys.modules[type(model).__module__]
    before, params = _classes(model), dict(tree_flatten(model.parameters()))
    tokens = mx.arange(14)[None] * 7 % 250
    ref = _steps(model, tokens)
    done = fast_ops.install(model)
    assert done.attention_modules == [module.__name__] and done.generate_logsumexp
    per_layer = 3 if arch == "llama" else 2  # MLP, Attention (and llama's TransformerBlock)
    stack = 1 if arch == "llama" else 0  # and llama's LlamaModel (kernels/native_stack.py)
    assert done.layers > 0
    assert done.native == (0 if native.get() is None else per_layer * len(model.layers) + stack)
    assert fast_ops.installed() == {
        "attention_modules": [module.__name__],
        "generate_logsumexp": True,
    }
    assert _classes(model) != before
    assert all(a.shape == b.shape for a, b in zip(ref, _steps(model, tokens)))
    for a, b in zip(ref, _steps(model, tokens)):
        assert same_bits(a, b)
    off = fast_ops.uninstall(model)
    assert (off.attention_modules, off.layers, off.native) == (
        done.attention_modules,
        done.layers,
        done.native,
    )
    assert _classes(model) == before  # mlx-lm's classes and nn modules, the same arrays
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert sys.modules["mlx_lm.generate"].mx is mx
    assert fast_ops.installed() == {"attention_modules": [], "generate_logsumexp": False}


def test_make_target_runs_a_model_as_it_is(stock_names) -> None:
    from mlx_lm.models import base
    from tiny import tiny_model

    from adaspec.targets import make_target

    model = tiny_model("llama")
    before = _classes(model)
    target = make_target(model)
    target.prefill([5, 17, 99, 3])
    target.forward([42, 7])
    assert _classes(model) == before
    assert sys.modules["mlx_lm.models.llama"].scaled_dot_product_attention is (
        base.scaled_dot_product_attention
    )
    assert sys.modules["mlx_lm.generate"].mx is mx


def _rotating(model):
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model, max_kv_size=12)


def _quantized(model):
    from mlx_lm.models.cache import QuantizedKVCache

    return [QuantizedKVCache(group_size=32) for _ in model.layers]


def _llama(head_dim: int):
    from mlx_lm.models import llama

    mx.random.seed(1)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=4 * head_dim, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=256, tie_word_embeddings=True,
    )  # fmt: skip
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("case", ["rotating cache", "quantized cache", "half precision"])
def test_what_the_native_nodes_do_not_take_runs_mlx_lm_code(case, stock_names) -> None:
    """a rotating or quantized KV cache, half precision: mlx-lm's own code, stock bits"""
    model = _llama(32)  # quantized caches take groups of 32 values of a head
    if case == "half precision":
        model.set_dtype(mx.float16)
    maker = {"rotating cache": _rotating, "quantized cache": _quantized}.get(case)
    tokens = mx.arange(16)[None] * 5 % 250
    ref = _steps(model, tokens, maker)
    fast_ops.install(model)
    try:
        for a, b in zip(ref, _steps(model, tokens, maker), strict=True):
            assert np.array_equal(np.array(a), np.array(b)), case
    finally:
        fast_ops.uninstall(model)


def test_uninstall_without_install_changes_nothing(stock_names) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    assert fast_ops.uninstall(model) == fast_ops.Installed([], 0, False, 0)
    assert type(model.layers[0]) is nn.Linear
