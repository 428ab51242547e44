"""adaspec's own mlx primitives (kernels/native.py): attention, the cache nodes, projections
and decoder layers in one graph node each with stock mlx's bits, and mlx's own ops wherever
the extension cannot be built."""

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
    (14, 2, 7, 300, 2.0),  # 4 heads a GEMM: calls of 4 and 3 query heads
    (4, 4, 40, 100, 2.0),  # a prefill chunk past the routed kernel's rows
    (8, 1, 5, 77, 30.0),  # scores far apart: exp(x - max) below -88 gives 0
]


@pytest.mark.parametrize(("heads", "kv_heads", "q_len", "k_len", "scale"), CASES)
def test_attention_core_has_mlx_bits(heads, kv_heads, q_len, k_len, scale) -> None:
    q, k, v = qkv(q_len * 1000 + k_len, heads, kv_heads, q_len, k_len, spare=37, scale=scale)
    for mask in (None, "causal") if q_len > 1 else (None,):
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=64**-0.5, mask=mask)
        assert same_bits(attention.sdpa(q, k, v, scale=64**-0.5, mask=mask), ref)
        rep = heads // kv_heads  # every number of query heads per GEMM the routed kernel serves
        for fold in [f for f in range(1, rep + 1) if f == 1 or f * q_len <= blas.KERNEL_ROWS]:
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
        core().attention_core(q, k[:, :2], v[:, :2], 0.1, False, 1)
    with pytest.raises(ValueError, match="rank 4"):
        core().attention_core(q[0], k, v, 0.1, False, 1)
    with pytest.raises(ValueError, match="at least as many keys"):
        core().attention_core(*qkv(3, 9, 3, 8, 4), 0.1, True, 1)
    for fold in (0, 4):  # SmolLM2's 9 query heads on 3 KV heads: 1 to 3 per GEMM
        with pytest.raises(ValueError, match=f"fold {fold}; accepted: 1 to 3 query heads"):
            core().attention_core(q, k, v, 0.1, False, fold)


def test_without_a_compiler_attention_is_mlx_own(tmp_path, monkeypatch) -> None:
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


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mlp_and_attention_twins_keep_the_logits_and_come_off(arch):
    from mlx_lm.models.cache import make_prompt_cache
    from tiny import tiny_model

    from adaspec.kernels import layers, native_layers

    model, fresh = tiny_model(arch), tiny_model(arch)
    layers.install(model)  # the RoPE twin's angles are what the native attention reads
    mlps = [
        m
        for _, m in model.named_modules()
        if (type(m).__module__, type(m).__name__) in native_layers.COVERED
    ]
    assert native_layers.install(model) == len(mlps) > 0
    assert native_layers.install(model) == 0  # once only
    tokens = mx.array([[5, 17, 99, 3, 42, 7, 8, 250, 1, 2, 3]])
    c1, c2 = make_prompt_cache(model), make_prompt_cache(fresh)
    for chunk in (tokens[:, :9], tokens[:, 9:10], tokens[:, 10:]):  # prefill, then steps
        out = model(chunk, cache=c1)
        dot = io.StringIO()
        mx.export_to_dot(dot, out)
        if arch == "llama" and chunk.shape[1] < 9:  # after the prefill grew the cache
            assert "DecoderLayer" in dot.getvalue()  # the layer twin: one node
        elif arch == "qwen3":  # q/k norms: the attention and MLP twins
            assert "Linears" in dot.getvalue()
            if chunk.shape[1] < 9:  # RoPE, cache and attention
                assert "AttentionCache" in dot.getvalue() and "SliceUpdate" not in dot.getvalue()
        assert same_bits(out, fresh(chunk, cache=c2))
        assert c1[0].offset == c2[0].offset
        assert same_bits(c1[0].keys[..., : c1[0].offset, :], c2[0].keys[..., : c2[0].offset, :])
    assert native_layers.uninstall(model) == len(mlps)
    stock = [
        m
        for _, m in fresh.named_modules()
        if (type(m).__module__, type(m).__name__) in native_layers.COVERED
    ]
    assert len(stock) == len(mlps) and all(type(m) is type(f) for m, f in zip(mlps, stock))


def _cache_with(rng, kv_heads, context, dim=64):
    from mlx_lm.models.cache import KVCache

    a, b = KVCache(), KVCache()
    keys = mx.array(rng.standard_normal((1, kv_heads, context, dim)).astype(np.float32))
    values = mx.array(rng.standard_normal((1, kv_heads, context, dim)).astype(np.float32))
    a.update_and_fetch(keys, values), b.update_and_fetch(keys, values)
    return a, b


def _rope_call(c, q, k, rows=1, offset=None):
    """rope_attention_cache of one sequence with the identity rotation (cos 1, sin 0)"""
    m = q.shape[1]
    cos, sin = mx.ones((m, 32)), mx.zeros((m, 32))
    offset = c.offset if offset is None else offset
    return core().rope_attention_cache(
        q, k, k, cos, sin, 64, 9, 3, [c.keys], [c.values], [rows], [offset], [3], 0.1
    )


def test_rope_attention_cache_refuses_a_buffer_without_room():
    rng = np.random.default_rng(1)
    _, c = _cache_with(rng, 3, 250)
    q, k = mx.zeros((1, 8, 9 * 64)), mx.zeros((1, 8, 3 * 64))
    with pytest.raises(ValueError, match="room for offset"):
        _rope_call(c, q, k, rows=8, offset=250)


def test_attend_rows_gives_each_sequence_its_solo_attention():
    """Several sequences' rows through one layer's attention in two native nodes: each
    sequence's output rows and cache equal mlx-lm's stock attention run on it alone."""
    from mlx_lm.models.cache import KVCache
    from tiny import tiny_model

    from adaspec.kernels import layers, native_layers

    model, fresh = tiny_model("llama"), tiny_model("llama")
    layers.install(model)
    attn, stock = model.model.layers[0].self_attn, fresh.model.layers[0].self_attn
    rng = np.random.default_rng(3)
    hidden = model.model.layers[0].self_attn.q_proj.weight.shape[1]
    rows, contexts = [1, 4, 2], [7, 30, 1]
    ours, refs, outs = [], [], []
    for n, ctx in zip(rows, contexts):
        a, b = KVCache(), KVCache()
        pre = mx.array(rng.standard_normal((1, ctx, hidden)).astype(np.float32))
        attn(pre, "causal" if ctx > 1 else None, a), stock(pre, "causal" if ctx > 1 else None, b)
        x = mx.array(rng.standard_normal((1, n, hidden)).astype(np.float32))
        outs.append(stock(x, "causal" if n > 1 else None, b))
        ours.append((a, x))
        refs.append(b)
    angles = [attn.rope._cos_sin(c.offset, n) for (c, _), n in zip(ours, rows)]
    cos = mx.concatenate([c for c, _ in angles])
    sin = mx.concatenate([s for _, s in angles])
    x = mx.concatenate([x for _, x in ours], axis=1)
    out = native_layers.attend_rows(attn, x, [c for c, _ in ours], rows, cos, sin)
    assert out is not None and same_bits(out, mx.concatenate(outs, axis=1))
    for (c, _), r in zip(ours, refs):
        assert c.offset == r.offset
        assert same_bits(c.keys[..., : c.offset, :], r.keys[..., : r.offset, :])


def test_gradients_through_the_native_nodes_are_mlx_ones():
    """A drafter trained through them (DFlash calls attention.sdpa, with an array mask) gets
    the gradients of mlx's own attention and matmuls."""
    q, k, v = qkv(9, 9, 3, 4, 40)
    w = mx.random.normal((1, 9, 4, 64))
    keep = mx.array(np.random.default_rng(4).random((4, 40)) < 0.7)
    for mask in ("causal", keep):
        causal = isinstance(mask, str)

        def ours(q, k, v, mask=mask, causal=causal):
            m = None if causal else mask
            return (core().attention_core(q, k, v, 0.125, causal, 3, m) * w).sum()

        def stock(q, k, v, mask=mask):
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
            return (out * w).sum()

        for a, b in zip(mx.grad(ours, (0, 1, 2))(q, k, v), mx.grad(stock, (0, 1, 2))(q, k, v)):
            assert same_bits(a, b)
    x, w1, w2, b2 = (mx.random.normal(s) for s in ((1, 3, 16), (8, 16), (5, 16), (5,)))

    def lin(x, w1, w2, b2):
        y1, y2 = core().linears(x, [w1, w2], [None, b2])
        return (y1 * y1).sum() + (y2 * 3).sum()

    def ref(x, w1, w2, b2):
        return ((x @ w1.T) ** 2).sum() + ((x @ w2.T + b2) * 3).sum()

    for a, b in zip(
        mx.grad(lin, (0, 1, 2, 3))(x, w1, w2, b2), mx.grad(ref, (0, 1, 2, 3))(x, w1, w2, b2)
    ):
        assert np.allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)


def test_cache_buffers_are_written_in_place_only_when_nothing_else_holds_them():
    """As mlx's SliceUpdate: a buffer only this node holds is written in place (no copy per
    decoding step); one held elsewhere is copied first, and the holder sees it unchanged."""
    rng = np.random.default_rng(2)
    _, c = _cache_with(rng, 3, 40)
    q = mx.array(rng.standard_normal((1, 1, 9 * 64)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 1, 3 * 64)).astype(np.float32))
    held = c.keys
    before = np.array(held)
    copies = core().buffer_copies()
    out = _rope_call(c, q, k)
    c.keys, c.values, c.offset = out[1], out[2], c.offset + 1
    mx.eval(out[0])
    assert core().buffer_copies() == copies + 1  # the keys: held; the values: donated
    assert np.array_equal(np.array(held), before)
    del held, out
    for _ in range(3):  # steady decoding: nothing else holds the buffers
        copies = core().buffer_copies()
        out = _rope_call(c, q, k)
        c.keys, c.values, c.offset = out[1], out[2], c.offset + 1
        mx.eval(out[0])
        del out
        assert core().buffer_copies() == copies


def _in_flight_step(c, q, k, busy=None):
    """one decoding step, queued behind `busy` work when given (so it is still running when
    the caller goes on, as in mlx_lm's loop), the cache advanced to it"""
    out = _rope_call(c, q if busy is None else q + busy, k)
    c.keys, c.values, c.offset = out[1], out[2], c.offset + 1
    mx.async_eval(out[0])
    return out[0]


@pytest.mark.parametrize("rollback", [False, True])
def test_a_step_queued_behind_one_in_flight_writes_in_place_unless_rows_are_rewritten(rollback):
    """mlx_lm evaluates step n + 1's graph while step n still runs, when step n's own work
    holds the cache buffers: past every row written so far they are still written in place (no
    copy a step); a rewritten row (a rollback) goes into a copy. Either way what a holder of
    the old buffer reads stays as it was, and the cache ends as a step-by-step run's."""
    rng = np.random.default_rng(5)
    a, c = _cache_with(rng, 3, 40)
    q = mx.array(rng.standard_normal((1, 1, 9 * 64)).astype(np.float32))
    k1, k2 = (mx.array(rng.standard_normal((1, 1, 3 * 64)).astype(np.float32)) for _ in "12")
    big = mx.random.normal((1500, 1500))
    mx.eval(big)
    busy = (big @ big @ big @ big @ big).sum().reshape(1, 1, 1) * 0  # ~0.1 s on the stream
    _in_flight_step(c, q, k1, busy)
    view = c.keys[:, :, : c.offset]  # a holder of the buffer being written: 41 rows
    mx.async_eval(view)
    if rollback:
        c.offset -= 1  # step n + 1 rewrites step n's row
    copies = core().buffer_copies()
    mx.eval(_in_flight_step(c, q, k2), view)
    assert core().buffer_copies() == copies + (2 if rollback else 0)
    _in_flight_step(a, q, k1)  # the same steps, each evaluated before the next
    mx.eval(a.keys)
    seen = np.array(a.keys[:, :, :41])
    a.offset -= rollback
    mx.eval(_in_flight_step(a, q, k2))
    assert np.array_equal(np.array(view).view(np.uint32), seen.view(np.uint32))
    assert same_bits(c.keys[..., : c.offset, :], a.keys[..., : a.offset, :])
    assert same_bits(c.values[..., : c.offset, :], a.values[..., : a.offset, :])


@pytest.mark.slow
def test_stored_embedding_rows_are_lazy_and_exact(smollm2):
    """SmolLM2's stored (Q8_0) embedding: the native gather equals the numpy gather's widened
    rows for every id shape and dtype, builds without evaluating the ids, and an id out of
    range fails at evaluation, naming it."""
    from adaspec.kernels import stored

    model, _ = smollm2
    emb = model.model.embed_tokens
    st = emb._stored
    for dtype in (mx.int32, mx.uint32, mx.int64):
        ids = mx.array([[0, 5, st.n - 1], [1234, 7, 99]], dtype=dtype)
        ref = stored.values(st.type_name, st.raw[np.array(ids).reshape(-1)], st.k)
        assert same_bits(emb(ids), mx.array(ref.reshape(2, 3, st.k)))
    lazy = mx.argmax(mx.ones((1, 10)), axis=-1)  # not evaluated yet
    out = emb(lazy[None])
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    assert "StoredRows" in dot.getvalue()
    with pytest.raises(RuntimeError, match=f"token id {st.n} out of range 0..{st.n - 1}"):
        mx.eval(emb(mx.array([st.n])))


def _qwen2(seed=0):
    """a tiny qwen2 (q/k/v biases, GQA) in the shape of testing.models.tiny_model's"""
    from mlx_lm.models import qwen2

    mx.random.seed(seed)
    args = qwen2.ModelArgs(
        model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=300,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = qwen2.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decoder_layer_keeps_the_logits_and_the_cache(arch):
    """With every fast path installed, llama and qwen2 layers decode in one DecoderLayer node
    (where the cache has room for the rows), bit for bit stock mlx-lm: logits and cache
    contents after a prefill, steps of 1 and 3 rows and a 32-row verify; qwen3 (q/k norms)
    keeps the other nodes."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    from tiny import tiny_model

    from adaspec.kernels import fast_ops

    make = (lambda: _qwen2()) if arch == "qwen2" else (lambda: tiny_model(arch))
    model, fresh = make(), make()
    fast_ops.install(model)
    tokens = mx.array([[(7 * i + 5) % 250 for i in range(60)]])
    c1, c2 = make_prompt_cache(model), make_prompt_cache(fresh)
    at = 0
    for n in (9, 1, 3, 32, 1):
        chunk = tokens[:, at : at + n]
        out = model(chunk, cache=c1)
        dot = io.StringIO()
        mx.export_to_dot(dot, out)
        assert ("DecoderLayer" in dot.getvalue()) == (arch != "qwen3" and at > 0)
        assert same_bits(out, fresh(chunk, cache=c2))
        for a, b in zip(c1, c2):
            assert a.offset == b.offset
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert same_bits(x[..., : a.offset, :], y[..., : b.offset, :])
        at += n
    trim_prompt_cache(c1, 32), trim_prompt_cache(c2, 32)  # a rejected verify, then a step
    assert same_bits(model(tokens[:, :1], cache=c1), fresh(tokens[:, :1], cache=c2))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_models_layers_are_made_in_one_call_with_the_same_bits(arch, monkeypatch):
    """The model twin runs every layer in one node made by one call (no layer's __call__ runs)
    where the caches have room, bit for bit stock mlx-lm; a new weight, a spy in the layer
    list or more rows than the layer node takes go back to the layers' own calls, with the same
    bits."""
    from mlx_lm.models.cache import make_prompt_cache
    from tiny import tiny_model

    from adaspec.kernels import fast_ops, native_stack
    from adaspec.targets.base import Spy

    make = (lambda: _qwen2()) if arch == "qwen2" else (lambda: tiny_model(arch))
    model, fresh = make(), make()
    fast_ops.install(model)
    twin = type(model.model.layers[0])
    calls = []
    own = twin.__call__
    monkeypatch.setattr(twin, "__call__", lambda *a, **k: calls.append(1) or own(*a, **k))
    tokens = mx.array([[(7 * i + 5) % 250 for i in range(90)]])
    c1, c2 = make_prompt_cache(model), make_prompt_cache(fresh)
    rng = np.random.default_rng(3)
    at = 0
    for n, expect_calls in ((9, True), (1, False), (3, False), ("new weight", False),
                            ("spy", True), (33, True), (2, False)):  # fmt: skip
        layers = model.model.layers
        if n == "new weight":  # the same new array in both models
            w = mx.array(rng.standard_normal(layers[1].mlp.down_proj.weight.shape), mx.float32)
            layers[1].mlp.down_proj.weight = w
            fresh.model.layers[1].mlp.down_proj.weight = w
        if n == "spy":
            layers[0] = Spy(layers[0])
        rows = 1 if isinstance(n, str) else n
        calls.clear()
        chunk = tokens[:, at : at + rows]
        out = model(chunk, cache=c1)
        assert bool(calls) == expect_calls, n
        assert native_stack.stacks(model.model, rows) == (not expect_calls or rows == 9), n
        dot = io.StringIO()
        mx.export_to_dot(dot, out)
        nodes = re.findall(r'label ="(DecoderLayers?)"', dot.getvalue())
        assert (nodes == ["DecoderLayers"]) == (not expect_calls), (n, nodes)  # one node
        assert same_bits(out, fresh(chunk, cache=c2)), n
        for a, b in zip(c1, c2):
            assert a.offset == b.offset
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert same_bits(x[..., : a.offset, :], y[..., : b.offset, :])
        if n == "spy":
            layers[0] = layers[0].module
        at += rows


def test_decoder_stack_refuses_what_it_cannot_make():
    from tiny import tiny_model

    block = tiny_model("llama").model.layers[0]
    ws = [block[a][p]["weight"] for a, p in (
        ("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
        ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"),
    )]  # fmt: skip
    norm = block.input_layernorm.weight
    with pytest.raises(ValueError, match="per layer"):
        core().DecoderStack([norm], [norm], [1e-5], [], [ws], [[None] * 7], 16, 4, 2, 0.25)
    stack = core().DecoderStack([norm], [norm], [1e-5], [1e-5], [ws], [[None] * 7], 16, 4, 2, 0.25)
    assert len(stack) == 1
    kb, x, cos = mx.zeros((1, 2, 16, 16)), mx.zeros((1, 2, 64)), mx.zeros((2, 8))
    mx.eval(stack(x, [kb], [kb], 2, 0, 1, cos, cos))
    with pytest.raises(ValueError, match=r"per layer \(1\)"):
        stack(x, [kb, kb], [kb, kb], 2, 0, 1, cos, cos)
    with pytest.raises(ValueError, match="room for offset"):
        stack(x, [kb], [kb], 2, 15, 1, cos, cos)


def test_decoder_layer_refuses_what_it_cannot_compute():
    from tiny import tiny_model

    block = tiny_model("llama").model.layers[0]
    x, kb = mx.zeros((1, 2, 64)), mx.zeros((1, 2, 16, 16))
    ws = [block[a][p]["weight"] for a, p in (
        ("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
        ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"),
    )]  # fmt: skip
    norm = block.input_layernorm.weight
    cos = mx.zeros((2, 8))

    def call(weights=ws, biases=[None] * 7, x=x, offset=0, cos=cos):
        return core().decoder_layer(
            x, norm, norm, 1e-5, 1e-5, weights, biases, cos, cos, 16, 4, 2, [kb], [kb], [2],
            [offset], [1], 0.25,
        )  # fmt: skip

    mx.eval(call())
    with pytest.raises(ValueError, match="seven weights"):
        call(weights=ws[:6])
    with pytest.raises(ValueError, match="layer's shapes"):
        call(weights=[ws[1], *ws[1:]])
    with pytest.raises(ValueError, match="room for offset"):
        call(offset=15)
    with pytest.raises(ValueError, match=r"x fp32 \[1, M, H\]"):
        call(x=mx.zeros((2, 2, 64)))
    with pytest.raises(ValueError, match="dims/2"):
        call(cos=mx.zeros((3, 8)))
