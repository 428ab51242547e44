"""Tiny GGUF files written with the gguf package's own writer, plus the weights they hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
    "def main(argv):\n    return sum(int(x) for x in argv[1:]) * 42\n"
    "Numbers 12345 and 3.14159; unicode: café, naïve, 日本語, emoji 🙂.\n"
) * 4
# Row length 256 suits every block size (32 for Q4_0..Q8_0, 256 for K-quants).
DIMS = {"hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 256, "layers": 2}
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@lru_cache(maxsize=1)
def trained_tokenizer():
    """A small byte-level BPE trained on TEXT (what a GGUF's gpt2 tokenizer describes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([TEXT], trainer)
    return tk


def vocab_and_merges() -> tuple[list[str], list[str]]:
    import json

    model = json.loads(trained_tokenizer().to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in vocab], merges


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row interleaving (as in its HF -> GGUF converter); works on raw rows too."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class TinyModel:
    path: Path
    arch: str
    qtype: str
    config: dict
    original: dict[str, np.ndarray]  # HF names, float32, before quantization
    stored: dict[str, np.ndarray] = field(default_factory=dict)  # what the file holds, HF layout


def _hf_weights(arch: str, tied: bool, rng: np.random.Generator, vocab: int) -> dict:
    h, heads, kv, ffn = DIMS["hidden"], DIMS["heads"], DIMS["kv_heads"], DIMS["ffn"]
    hd = h // heads

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(vocab, h), "model.norm.weight": norm(h)}
    if not tied:
        w["lm_head.weight"] = mat(vocab, h)
    for i in range(DIMS["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        for name, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            w[p + f"self_attn.{name}.weight"] = mat(rows, h)
            if arch == "qwen2":
                w[p + f"self_attn.{name}.bias"] = (0.1 * rng.standard_normal(rows)).astype(
                    np.float32
                )
        w[p + "self_attn.o_proj.weight"] = mat(h, heads * hd)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "mlp.gate_proj.weight"] = mat(ffn, h)
        w[p + "mlp.up_proj.weight"] = mat(ffn, h)
        w[p + "mlp.down_proj.weight"] = mat(h, ffn)
    return w


_GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    module, kind = hf.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, i, rest = module.split(".", 3)
        return f"blk.{i}.{_GGUF_NAMES[rest]}.{kind}"
    return f"{_GGUF_NAMES[module]}.{kind}"


# Offsets of the f16 super-block scales (d, and dmin where present) in each K-quant block.
K_F16_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_k_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw K-quant rows with small, finite f16 scales (gguf-py cannot quantize K-types)."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in K_F16_AT[qtype]:
        scale = rng.uniform(0.0005, 0.004, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, cols // block * size)


def _quantized(
    arr: np.ndarray, qtype: str, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(raw data for the file in HF row order, its float32 dequantization)."""
    import gguf
    from gguf import quants

    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return arr, arr
    if qtype == "F16":
        raw = arr.astype(np.float16)
        return raw, raw.astype(np.float32)
    if qtype in K_QUANTS:
        raw = random_k_blocks(qtype, arr.shape[0], arr.shape[1], rng)
    else:
        raw = quants.quantize(arr, t)
    return raw, quants.dequantize(raw, t).astype(np.float32).reshape(arr.shape)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    qtype: str = "F32",
    *,
    tied: bool = True,
    seed: int = 0,
    pre: str = "default",
) -> TinyModel:
    """Write a 2-layer `arch` model whose 2-D weights are stored as `qtype`."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, merges = vocab_and_merges()
    original = _hf_weights(arch, tied, rng, len(tokens))
    heads, kv = DIMS["heads"], DIMS["kv_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(DIMS["layers"])
    w.add_context_length(256)
    w.add_embedding_length(DIMS["hidden"])
    w.add_feed_forward_length(DIMS["ffn"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "qwen3":
        w.add_key_length(DIMS["hidden"] // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    model = TinyModel(path, arch, qtype, {}, original)
    for name, arr in original.items():
        raw, stored = _quantized(arr, qtype, rng) if arr.ndim == 2 else (arr, arr)
        model.stored[name] = stored
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            raw = permute(raw, heads if ".q_proj." in name else kv)
        raw_dtype = None
        if raw.dtype == np.uint8:
            raw_dtype = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(gguf_name(name), raw, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


# Largest |loaded - original| / max|original| each type's rounding allows (random weights).
TOLERANCE = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 8e-3,
    "Q8_0": 1e-2,
    "Q5_0": 5e-2,
    "Q5_1": 5e-2,
    "Q4_0": 0.1,
    "Q4_1": 0.1,
}
