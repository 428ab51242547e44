"""GGUF -> mlx-lm conversion on tiny files written by the gguf package's own writer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf_fixtures import (
    CHAT_TEMPLATE,
    K_QUANTS,
    SPECIALS,
    TEXT,
    TOLERANCE,
    trained_tokenizer,
    write_tiny_gguf,
)

import adaspec  # noqa: F401  (loads the fast BLAS before mlx)
from adaspec.errors import ModelLoadError
from adaspec.targets import gguf as g

ARCHS = ("llama", "qwen2", "qwen3")
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *K_QUANTS)


def _convert(tmp_path, arch, qtype, dtype="float32", **kw):
    tiny = write_tiny_gguf(tmp_path / f"{arch}-{qtype}.gguf", arch, qtype, **kw)
    out = tmp_path / f"{arch}-{qtype}-{dtype}"
    out.mkdir()
    g.convert(tiny.path, out, dtype=dtype)
    return tiny, out


def _weights(folder):
    import mlx.core as mx

    return {
        k: np.array(v.astype(mx.float32))
        for k, v in mx.load(str(folder / "model.safetensors")).items()
    }


def _reference_model(config, weights):
    """The same mlx-lm architecture built directly from HF-layout weights."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model


def _logits(model, ids):
    import mlx.core as mx

    return np.array(model(mx.array([ids])).astype(mx.float32))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_weights_and_forward_match_originals(tmp_path, arch, qtype):
    import mlx_lm

    tiny, out = _convert(tmp_path, arch, qtype, tied=(arch != "llama"))
    loaded = _weights(out)
    assert set(loaded) == set(tiny.original)
    for name, want in tiny.stored.items():
        # What the file holds, dequantized and un-permuted, exactly.
        np.testing.assert_array_equal(loaded[name], want, err_msg=name)
        if qtype in TOLERANCE:  # K-quants hold random blocks, not a quantized original
            err = np.abs(loaded[name] - tiny.original[name]).max()
            assert err <= TOLERANCE[qtype] * np.abs(tiny.original[name]).max() + 1e-7, name

    model, tok = mlx_lm.load(str(out))
    ref = _reference_model(json.loads((out / "config.json").read_text()), tiny.stored)
    ids = tok.encode(TEXT[:120])
    np.testing.assert_allclose(_logits(model, ids), _logits(ref, ids), rtol=1e-4, atol=1e-4)


def test_llama_qk_are_unpermuted(tmp_path):
    """Without un-permuting, q/k rows would be in llama.cpp's interleaved order."""
    tiny, out = _convert(tmp_path, "llama", "F32")
    loaded = _weights(out)
    q = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(loaded[q], tiny.original[q])
    assert not np.array_equal(g._unpermute(tiny.original[q], 4), tiny.original[q])


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_heads(tmp_path, tied):
    tiny, out = _convert(tmp_path, "qwen2", "Q8_0", tied=tied)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in _weights(out)) is not tied


def test_config_from_metadata(tmp_path):
    _, out = _convert(tmp_path, "qwen3", "F32")
    c = json.loads((out / "config.json").read_text())
    assert c["model_type"] == "qwen3"
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (256, 4, 2)
    assert (c["head_dim"], c["intermediate_size"], c["num_hidden_layers"]) == (64, 256, 2)
    assert c["rope_theta"] == 10000.0 and c["max_position_embeddings"] == 256
    assert c["rms_norm_eps"] == pytest.approx(1e-6)
    eos = trained_tokenizer().token_to_id("<|im_end|>")
    assert eos in c["eos_token_id"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_output_dtype(tmp_path, dtype):
    import mlx.core as mx

    tiny, out = _convert(tmp_path, "llama", "F32", dtype=dtype)
    arrays = mx.load(str(out / "model.safetensors"))
    assert {str(a.dtype) for a in arrays.values()} == {f"mlx.core.{dtype}"}
    name = "model.layers.1.mlp.up_proj.weight"
    got = np.array(arrays[name].astype(mx.float32))
    np.testing.assert_allclose(got, tiny.original[name], rtol=1e-2, atol=1e-3)


def test_tokenizer_round_trip(tmp_path):
    import mlx_lm

    tiny, out = _convert(tmp_path, "llama", "Q8_0")
    _, tok = mlx_lm.load(str(out))
    original = trained_tokenizer()
    samples = [
        TEXT,
        "  leading spaces\n\nand\ttabs",
        "unseen: Zürich ∑ 🙂🙂",
        "<|im_start|>x<|im_end|>",
    ]
    for text in samples:
        ids = tok.encode(text)
        assert ids == original.encode(text).ids
        assert tok.decode(ids) == text
    for special in SPECIALS:
        assert tok.encode(special) == [original.token_to_id(special)]
    assert tok.eos_token_ids >= {original.token_to_id("<|im_end|>")}
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


def test_pre_tokenizers_follow_gguf_pre_type(tmp_path):
    from adaspec.targets import gguf_tokenizer

    tokens = [chr(c) for c in range(33, 127)] + ["Ġ"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [],
    }
    digits = gguf_tokenizer.build({**meta, "tokenizer.ggml.pre": "smollm"}, 64)[0]
    plain = gguf_tokenizer.build({**meta, "tokenizer.ggml.pre": "default"}, 64)[0]
    assert digits.pre_tokenizer.pre_tokenize_str("a 123")[1:] == [
        ("Ġ", (1, 2)),
        ("1", (2, 3)),
        ("2", (3, 4)),
        ("3", (4, 5)),
    ]
    assert plain.pre_tokenizer.pre_tokenize_str("a 123")[1][0] == "Ġ123"
    qwen = gguf_tokenizer.build({**meta, "tokenizer.ggml.pre": "qwen2"}, 64)[0]
    assert [p for p, _ in qwen.pre_tokenizer.pre_tokenize_str("x 12")] == ["x", "Ġ", "1", "2"]


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    p = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(p), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    (tmp_path / "o").mkdir()
    with pytest.raises(ModelLoadError, match="'gemma'.*accepted: llama, qwen2, qwen3"):
        g.convert(p, tmp_path / "o")


def test_unsupported_tensor_type_is_named(tmp_path):
    import gguf

    p = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    raw = np.zeros((4, 66), np.uint8)  # one TQ2_0 block (256 values) per row
    w.add_tensor("token_embd.weight", raw, raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    (tmp_path / "o").mkdir()
    with pytest.raises(ModelLoadError, match="TQ2_0"):
        g.convert(p, tmp_path / "o")


def test_unknown_tensor_is_named():
    with pytest.raises(ModelLoadError, match="blk.0.ffn_gate_exps.weight"):
        g.hf_name("blk.0.ffn_gate_exps.weight")
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        g.hf_name("rope_freqs.weight")


def test_missing_foreign_and_truncated_files(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        g.open_reader(tmp_path / "nope.gguf")
    text = tmp_path / "text.gguf"
    text.write_text("hello, not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        g.open_reader(text)
    tiny = write_tiny_gguf(tmp_path / "t.gguf", "llama", "Q8_0")
    data = tiny.path.read_bytes()
    for keep in (len(data) - 1000, len(data) // 2, 200):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(ModelLoadError, match="truncated"):
            g.open_reader(cut)


def test_bad_dtype_is_named():
    with pytest.raises(ModelLoadError, match="'int8'.*float32, float16, bfloat16"):
        g.check_dtype("int8")


def test_bos_is_prepended_when_the_gguf_asks():
    from adaspec.targets import gguf_tokenizer

    tokens = ["<s>", *[chr(c) for c in range(33, 127)]]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }
    tk, config = gguf_tokenizer.build(meta, 64)
    assert tk.encode("ab").ids == [0, tokens.index("a"), tokens.index("b")]
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>"
    tk, config = gguf_tokenizer.build({**meta, "tokenizer.ggml.add_bos_token": False}, 64)
    assert tk.encode("ab").ids == [tokens.index("a"), tokens.index("b")]


def test_unsupported_tokenizer_model_is_named():
    from adaspec.targets import gguf_tokenizer

    with pytest.raises(ModelLoadError, match="'llama'.*accepted: 'gpt2'"):
        gguf_tokenizer.build({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": []}, 8)
