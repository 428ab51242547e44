"""The q8 arithmetic (kernels/q8.h, kernels/arithmetic.py): the vector kernel equals the scalar
reference bit for bit, a token row's result does not depend on the rows beside it, and
speculative decoding on a q8 model gives that model's own AR output and distribution."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf_fixtures import K_F16_AT, TEXT, write_tiny_gguf
from test_stored import half, isa, last_logits, same_bits  # noqa: F401  (isa: a fixture)

import adaspec  # noqa: F401  (the router before mlx)
from adaspec.errors import ModelLoadError, SettingsError
from adaspec.kernels import arithmetic, blas, stored

pytestmark = pytest.mark.skipif(stored.router() is None, reason="needs the routed kernel")
TYPES = ("F32", *stored.TYPES)


def q8_gemm(vector: bool, type_name: str, raw: np.ndarray, n: int, k: int, a: np.ndarray,
            beta: float = 0.0, c0: np.ndarray | None = None) -> np.ndarray | None:  # fmt: skip
    """C = A B^T (+ beta C0) in the q8 arithmetic; None when the vector kernel cannot run."""
    code = 0 if type_name == "F32" else stored.TYPES[type_name][0]
    m = a.shape[0]
    c = np.zeros((m, n), np.float32) if c0 is None else c0.copy()
    a = np.ascontiguousarray(a)
    rc = blas._router.adaspec_q8_sgemm(
        int(vector), code, m, n, k, ctypes.c_float(1.0), ctypes.c_void_p(a.ctypes.data), k,
        ctypes.c_void_p(raw.ctypes.data), ctypes.c_float(beta), ctypes.c_void_p(c.ctypes.data), n,
    )  # fmt: skip
    if rc == -2:
        return None
    assert rc == 0, rc
    return c


def matrix(type_name: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, int, np.ndarray]:
    """(raw rows, k, the fp32 expansion) of random blocks with realistic scales."""
    if type_name == "F32":
        w = rng.standard_normal((n, 608)).astype(np.float32)
        return w.view(np.uint8), 608, w
    _, elems, size = stored.TYPES[type_name]
    k = 768 if elems == 256 else 608
    raw = rng.integers(0, 256, size=(n, k // elems * size), dtype=np.uint8)
    for off in K_F16_AT.get(type_name, (0, 2) if elems == 32 else ()):
        raw.reshape(n, -1, size)[:, :, off : off + 2] = half(rng.integers(0x2000, 0x2C00, 1))
    if elems == 1:
        raw = half(rng.integers(0x3000, 0x3C00, n * k)).reshape(n, -1)
    return raw, k, stored.values(type_name, raw, k, vector=False)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q6_K", "Q4_K"])
def test_each_sub_blocks_sum_is_the_sum_of_its_codes(type_name):
    """The quantizer's per-sub-block sums (which the offsets and mins multiply) equal the sums
    of the codes, for row lengths whose last 64 codes are whole or not."""
    code = stored.TYPES[type_name][0]
    rng = np.random.default_rng(code)
    f = blas._router.adaspec_q8_activations
    for k in (32, 96, 256, 576, 768, 1536, 8960):
        m = 3
        a = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
        codes = np.zeros((m, k), np.int8)
        sums = np.zeros(m * (k // 16), np.int32)  # m rows of k / s sums, one after the other
        s = f(code, m, k, ctypes.c_void_p(a.ctypes.data), ctypes.c_void_p(codes.ctypes.data),
              ctypes.c_void_p(sums.ctypes.data))  # fmt: skip
        if s == -3:  # k is not a whole number of this type's super-blocks
            assert k % stored.TYPES[type_name][1], (type_name, k)
            continue
        want = codes.astype(np.int64).reshape(m, k // s, s).sum(axis=2)
        assert np.array_equal(sums[: m * (k // s)].reshape(m, k // s), want), (type_name, k)


@pytest.mark.parametrize("type_name", TYPES)
def test_each_row_is_the_same_bits_in_any_batch_and_equals_the_reference(type_name, isa):  # noqa: F811
    """On either kernel (AVX-512 VNNI, AVX2)."""
    rng = np.random.default_rng(3)
    n = 77  # two threads (32 + 45 outputs), the last group of 16 partial
    raw, k, _ = matrix(type_name, n, rng)
    a = rng.standard_normal((33, k)).astype(np.float32)
    c0 = rng.standard_normal((33, n)).astype(np.float32)
    for beta in (0.0, 1.0):
        want = q8_gemm(False, type_name, raw, n, k, a, beta, c0)
        assert want is not None
        for m in (1, 2, 3, 4, 5, 8, 13, 32, 33):
            for at in sorted({0, 33 - m, (33 - m) // 2}):
                rows = slice(at, at + m)
                ref = q8_gemm(False, type_name, raw, n, k, a[rows], beta, c0[rows])
                assert same_bits(ref, want[rows]), (m, at, beta)
                got = q8_gemm(True, type_name, raw, n, k, a[rows], beta, c0[rows])
                assert got is not None and same_bits(got, want[rows]), (m, at, beta, isa)


@pytest.mark.parametrize("type_name", TYPES)
def test_q8_is_close_to_the_exact_product(type_name):
    """Shared by the kernel and the reference, the decoding of each type must be right: the
    8-bit product stays within a few percent of the fp32 one."""
    rng = np.random.default_rng(4)
    raw, k, expansion = matrix(type_name, 40, rng)
    a = rng.standard_normal((5, k)).astype(np.float32)
    got = q8_gemm(False, type_name, raw, 40, k, a)
    exact = a @ expansion.T
    assert np.abs(got - exact).max() < 0.03 * np.abs(exact).max()


def test_a_row_length_the_format_cannot_take_is_refused():
    raw = np.zeros((16, 144 * 3), np.uint8)  # Q4_K rows of 768: fine; 544 is not whole blocks
    a = np.zeros((1, 544), np.float32)
    c = np.zeros((1, 16), np.float32)
    rc = blas._router.adaspec_q8_sgemm(
        0, stored.TYPES["Q4_K"][0], 1, 16, 544, ctypes.c_float(1.0),
        ctypes.c_void_p(a.ctypes.data), 544, ctypes.c_void_p(raw.ctypes.data),
        ctypes.c_float(0.0), ctypes.c_void_p(c.ctypes.data), 16,
    )  # fmt: skip
    assert rc == -3


def test_bad_arithmetic_names_are_refused_with_the_choices():
    from adaspec.settings import from_env

    with pytest.raises(SettingsError, match="exact, q8"):
        from_env({"ADASPEC_ARITHMETIC": "int4"})
    with pytest.raises(ModelLoadError, match="accepted: exact, q8"):
        arithmetic.apply(object(), "int4")


@pytest.fixture(scope="module")
def q8_models(tmp_path_factory):
    """{type: (model set to q8, the same file loaded exact, tokenizer)} for tiny GGUF files."""
    from adaspec.settings import from_env
    from adaspec.targets import loader

    tmp = tmp_path_factory.mktemp("q8")
    out = {}
    for arch, qtype, tied in (("qwen2", "Q4_K", False), ("llama", "Q4_1", True),
                              ("qwen2", "Q6_K", True), ("llama", "F16", True)):  # fmt: skip
        path = write_tiny_gguf(tmp / f"{arch}-{qtype}.gguf", arch, qtype, tied=tied).path
        q8, tok = loader.load(path, settings=from_env({"ADASPEC_ARITHMETIC": "q8"}, cache=str(tmp)))
        exact, _ = loader.load(path, settings=from_env({}, cache=str(tmp)))
        out[qtype] = (q8, exact, tok)
    return out


def rows_logits(model, ids: list[int], rows: int, together: bool) -> np.ndarray:
    """Logits of the last `rows` ids after a prefill of the rest: one forward, or one a row."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(ids[:-rows])[None], cache=cache)
    if together:
        return np.array(model(mx.array(ids[-rows:])[None], cache=cache))[0]
    return np.stack([np.array(model(mx.array([[i]]), cache=cache))[0, 0] for i in ids[-rows:]])


def test_a_q8_model_gives_each_row_the_same_logits_in_a_verify_as_in_steps(q8_models):
    for qtype, (q8, exact, tok) in q8_models.items():
        assert arithmetic.of(q8) == "q8" and arithmetic.of(exact) == "exact"
        ids = tok.encode(TEXT)[:120]
        for rows in (2, 5, 8, 32):  # up to a verify's most rows
            steps = rows_logits(q8, ids, rows, together=False)
            assert same_bits(rows_logits(q8, ids, rows, together=True), steps), (qtype, rows)
        assert not same_bits(steps, rows_logits(exact, ids, rows, False)), qtype  # not exact


def test_exact_again_gives_the_exact_bits(q8_models):
    q8, exact, tok = q8_models["Q4_K"]
    ids = tok.encode(TEXT)[:60]
    try:
        arithmetic.apply(q8, "exact")
        assert arithmetic.of(q8) == "exact"
        assert same_bits(*last_logits([q8, exact], ids, 4))
    finally:
        arithmetic.apply(q8, "q8")


@pytest.mark.parametrize("drafter", ["pld", "suffix", "pld:min_ngram=1+suffix"])
def test_speculative_output_equals_q8_ar(q8_models, drafter):
    import mlx_lm

    for qtype, (q8, _, tok) in q8_models.items():
        for prompt in (TEXT[:80], "def main(argv):", "Numbers 12345 and"):
            want = mlx_lm.generate(q8, tok, prompt, max_tokens=40)
            got = adaspec.generate(q8, tok, prompt, drafter=drafter, max_tokens=40)
            assert got == want, (qtype, drafter, prompt)


def test_the_drafter_contract_holds_on_a_q8_target():
    """Greedy (any draft, adversarial ones included), boundaries, stop strings and the sampled
    distribution (chi-square), all against the q8 target's own outputs."""
    from adaspec.drafters.pld import PromptLookup
    from adaspec.testing import check_drafter
    from adaspec.testing.target import tiny_target

    target = tiny_target()
    arithmetic.apply(target, "q8")
    try:
        assert arithmetic.of(target) == "q8"
        report = check_drafter(PromptLookup, examples=10, runs=600)
        assert report.accepted > 0
    finally:
        arithmetic.apply(target, "exact")


def test_a_q8_draft_model_leaves_the_exact_target_exact_and_its_output_unchanged(tmp_path):
    """weights=q8: the draft model's own GEMMs run q8 (cheaper drafts); the target stays exact,
    so the output is still the exact target's AR output."""
    from tiny import ar_greedy, byte_tokenizer, save_tiny, tiny_model

    from adaspec.drafters.arms import make as make_drafter
    from adaspec.settings import from_env
    from adaspec.targets.base import target_info

    tok = byte_tokenizer()
    target = tiny_model("qwen3")
    folder = save_tiny(tiny_model("qwen3", seed=7, layers=1), tok, tmp_path / "draft")
    settings = from_env({}, cache=str(tmp_path / "cache"))
    d = make_drafter(f"draft-model:{folder},weights=q8", target_info(target, tok), settings)
    assert arithmetic.of(d.model) == "q8" and arithmetic.of(target) == "exact"
    calls = arithmetic.calls()
    prompt = [5, 9, 13, 5, 9]
    want = ar_greedy(target, prompt, 24)
    out = adaspec.stream_generate(target, tok, prompt, drafter=d, max_tokens=24)
    assert [r.token for r in out] == want
    assert arithmetic.calls() > calls  # the drafter drafted in q8
