"""4-bit copies of a drafter's wider stored weights (kernels/requant.py, `weights=q4`): the
Q4_1 blocks decode to the nearest of their 16 values, a requantized model holds only narrow
stored matrices and still computes about what it did, and a q4 draft model leaves the
target's output unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_fixtures import TEXT, write_tiny_gguf

import adaspec
from adaspec.errors import DrafterError, ModelLoadError
from adaspec.kernels import arithmetic, requant, stored

pytestmark = pytest.mark.skipif(stored.router() is None, reason="needs the routed kernel")


def test_q4_1_blocks_decode_to_the_nearest_of_their_sixteen_values():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 96)).astype(np.float32) * rng.uniform(0.01, 3, (5, 1))
    x[1, 32:64] = 0.25  # a constant block: step 0, every value the minimum
    blocks = requant.q4_1(x)
    assert blocks.shape == (5, 3 * 20) and blocks.dtype == np.uint8
    back = stored.values("Q4_1", blocks, 96)
    b = blocks.reshape(5, 3, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    grid = m[..., None] + d[..., None] * np.arange(16, dtype=np.float32)  # each block's values
    near = np.abs(x.reshape(5, 3, 32, 1) - grid[:, :, None, :]).min(-1)
    assert np.allclose(np.abs(back - x).reshape(5, 3, 32), near, atol=1e-6)
    assert np.all(np.abs(back - x).reshape(5, 3, 32) <= d[..., None] * 0.5 + 2e-3 * np.abs(x).max())
    assert np.array_equal(back[1, 32:64], np.full(32, 0.25, np.float32))
    with pytest.raises(ValueError, match="multiple of 32 values, not 40"):
        requant.q4_1(np.zeros((2, 40), np.float32))


@pytest.mark.parametrize("qtype", ["Q8_0", "F16", "Q4_K"])
def test_a_requantized_model_holds_narrow_matrices_and_computes_as_a_q4_1_file_does(
    tmp_path, qtype
):
    """Its logits are as near the fp32 model's as those of the same weights written as Q4_1
    by gguf's own converter (a tiny random model: 4 bits move its logits a lot)."""
    import mlx.core as mx

    from adaspec.settings import from_env
    from adaspec.targets import loader

    settings = from_env({}, cache=str(tmp_path))

    def load(q):
        return loader.load(
            write_tiny_gguf(tmp_path / f"{q}.gguf", "llama", q).path, settings=settings
        )

    model, tok = load(qtype)
    before = {s.type_name for s in model.adaspec_stored.matrices}
    replaced, released = requant.requantize(model)
    after = {s.type_name for s in model.adaspec_stored.matrices}
    assert after <= requant.KEPT
    if qtype == "Q4_K":  # narrow already: nothing to do
        assert (replaced, released) == (0, 0) and after == before
        return
    assert replaced == len(model.adaspec_stored.matrices) > 0 and released > 0
    assert after == {"Q4_1"}
    ids = mx.array(tok.encode(TEXT)[:40])[None]
    ref = np.array(load("F32")[0](ids)[0, -1])

    def cos(m):
        a = np.array(m(ids)[0, -1])
        return float(a @ ref / np.linalg.norm(a) / np.linalg.norm(ref))

    assert cos(model) > cos(load("Q4_1")[0]) - 0.02


def test_a_q4_draft_model_leaves_the_targets_output_unchanged(tmp_path):
    from adaspec.drafters.arms import make as make_drafter
    from adaspec.settings import from_env
    from adaspec.targets import loader
    from adaspec.targets.base import target_info

    settings = from_env({}, cache=str(tmp_path))
    target_path = write_tiny_gguf(tmp_path / "t.gguf", "llama", "Q8_0", seed=1).path
    draft_path = write_tiny_gguf(tmp_path / "d.gguf", "llama", "Q8_0", seed=1).path
    target, tok = loader.load(target_path, settings=settings)
    d = make_drafter(f"draft-model:{draft_path},weights=q4", target_info(target, tok), settings)
    assert arithmetic.of(d.model) == "q8" and arithmetic.of(target) == "exact"
    assert {s.type_name for s in d.model.adaspec_stored.matrices} == {"Q4_1"}
    assert {s.type_name for s in target.adaspec_stored.matrices} == {"Q8_0"}
    import mlx_lm

    for prompt in (TEXT[:60], "def main(argv):"):
        want = mlx_lm.generate(target, tok, prompt, max_tokens=30)
        assert adaspec.generate(target, tok, prompt, drafter=d, max_tokens=30) == want


def test_auto_weights_copy_a_gguf_draft_model_and_leave_a_folder_on_q8(tmp_path):
    """auto (with AVX-512 VNNI): q4 copies where the draft model has stored weights, q8 where
    it has none (an mlx-lm folder), neither an error."""
    from tiny import byte_tokenizer, save_tiny, tiny_model

    from adaspec.drafters.arms import make as make_drafter
    from adaspec.kernels import shadow
    from adaspec.settings import from_env
    from adaspec.targets import loader
    from adaspec.targets.base import target_info

    if shadow.resolve("auto", "x") != "q4":
        pytest.skip("auto picks q4 only with the q8 kernel's AVX-512 VNNI form")
    settings = from_env({}, cache=str(tmp_path))
    path = write_tiny_gguf(tmp_path / "t.gguf", "llama", "Q8_0", seed=2).path
    target, tok = loader.load(path, settings=settings)
    d = make_drafter(f"draft-model:{path}", target_info(target, tok), settings)
    assert {s.type_name for s in d.model.adaspec_stored.matrices} == {"Q4_1"}
    btok = byte_tokenizer()
    folder = save_tiny(tiny_model("qwen3", seed=7, layers=1), btok, tmp_path / "draft")
    info = target_info(tiny_model("qwen3"), btok)
    d = make_drafter(f"draft-model:{folder}", info, settings)
    assert arithmetic.of(d.model) == "q8" and getattr(d.model, "adaspec_stored", None) is None


def test_q4_is_refused_where_there_are_no_stored_weights(tmp_path):
    from tiny import byte_tokenizer, save_tiny, tiny_model

    from adaspec.drafters.arms import make as make_drafter
    from adaspec.settings import from_env
    from adaspec.targets.base import target_info

    tok = byte_tokenizer()
    target = tiny_model("qwen3")
    folder = save_tiny(tiny_model("qwen3", seed=7, layers=1), tok, tmp_path / "draft")
    settings = from_env({}, cache=str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="GGUF model's stored weights"):
        make_drafter(f"draft-model:{folder},weights=q4", target_info(target, tok), settings)
    with pytest.raises(
        DrafterError, match="weights='q4' is invalid; accepted: auto, fp32, bf16, q8"
    ):
        make_drafter("dflash:" + str(folder) + ",weights=q4", target_info(target, tok), settings)
