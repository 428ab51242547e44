"""Convert a GGUF file (llama, qwen2, qwen3) into an mlx-lm model folder with float weights.

Weights are dequantized with the `gguf` package (mx.load misreads K-quants and rejects Q5_0).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelLoadError
from . import gguf_tokenizer

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Tensor types the gguf package can dequantize and that these architectures' files use.
TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K",
)  # fmt: skip
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
MAGIC = b"GGUF"

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
    return dtype


def check_file(path: Path) -> None:
    """Cheap check that `path` exists and starts with the GGUF magic; raises ModelLoadError."""
    if not Path(path).is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise ModelLoadError(f"{str(path)!r} is not a GGUF file (starts {magic!r}, not b'GGUF')")


def open_reader(path: Path) -> Any:
    """A GGUFReader over `path`; a missing, foreign or truncated file raises ModelLoadError."""
    from gguf import GGUFReader

    path = Path(path)
    check_file(path)
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader fails in many ways on cut or damaged files
        raise ModelLoadError(f"GGUF file {str(path)!r} is truncated or corrupt: {exc}") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(
            f"GGUF file {str(path)!r} is truncated: tensors need {end} bytes, file has {size}"
        )
    return reader


def read_metadata(reader: Any) -> dict[str, Any]:
    """GGUF key/value metadata as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_name(name: str) -> str:
    """Hugging Face / mlx-lm parameter name of GGUF tensor `name`."""
    base, _, kind = name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 1 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{kind}"
    if base == "rope_freqs":
        raise ModelLoadError(
            "GGUF tensor 'rope_freqs.weight' (llama3-style rope scaling) is not supported"
        )
    raise ModelLoadError(f"GGUF tensor {name!r} is not supported for {', '.join(ARCHITECTURES)}")


def architecture(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; accepted: {', '.join(ARCHITECTURES)}"
        )
    return arch


def model_config(meta: dict[str, Any], shapes: dict[str, list[int]]) -> dict[str, Any]:
    """mlx-lm `config.json` for GGUF metadata `meta` and HF tensor shapes `shapes`."""
    arch = architecture(meta)

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks '{arch}.{key}'")
        return value

    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"GGUF {arch} with partial rotary embeddings is not supported")
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": shapes["model.embed_tokens.weight"][0],
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(get("rope.freq_base", 10000.0 if arch == "llama" else 1e6)),
        "tie_word_embeddings": "lm_head.weight" not in shapes,
    }
    if arch == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in shapes
        config["mlp_bias"] = "model.layers.0.mlp.up_proj.bias" in shapes
    elif arch == "qwen2" and head_dim * heads != hidden:
        raise ModelLoadError(f"GGUF qwen2 with head_dim {head_dim} != hidden/heads is unsupported")
    scaling = _rope_scaling(meta, arch)
    if scaling:
        config["rope_scaling"] = scaling
    eos = gguf_tokenizer.eos_ids(meta)
    if eos:
        config["eos_token_id"] = eos
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    return config


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn":
        original = int(meta.get(f"{arch}.rope.scaling.original_context_length", 0))
        return {"type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported; accepted: linear, yarn")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of q/k rows (done for its RoPE layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _plan(reader: Any) -> list[tuple[Any, str, list[int]]]:
    """(tensor, HF name, HF shape) for every tensor, after checking names and types."""
    plan = []
    for t in reader.tensors:
        if t.tensor_type.name not in TENSOR_TYPES:
            raise ModelLoadError(
                f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which is not supported; "
                f"accepted: {', '.join(TENSOR_TYPES)}"
            )
        plan.append((t, hf_name(t.name), [int(d) for d in reversed(t.shape.tolist())]))
    return plan


def permuted_heads(name: str, config: dict) -> int | None:
    """llama q/k weights: the head count whose interleaving of rows is undone; else None."""
    if config["model_type"] != "llama":
        return None
    module = name.rsplit(".", 1)[0].split(".", 3)[-1]
    heads = {"self_attn.q_proj": "num_attention_heads", "self_attn.k_proj": "num_key_value_heads"}
    return config[heads[module]] if module in heads else None


def _dequantized(plan: Iterable[tuple[Any, str, list[int]]], config: dict) -> Iterator[np.ndarray]:
    from gguf import quants

    for t, name, shape in plan:
        w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        heads = permuted_heads(name, config)
        yield w if heads is None else _unpermute(w, heads)


def stored_rows(t: Any, name: str, config: dict) -> np.ndarray:
    """GGUF tensor `t` as stored: rows of blocks (uint8, rows x bytes), in mlx-lm's row order."""
    raw = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[-1]), -1)
    heads = permuted_heads(name, config)
    return raw if heads is None else _unpermute(raw, heads)


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def write_safetensors(
    path: Path, names: list[str], shapes: list[list[int]], arrays: Iterator[np.ndarray], dtype: str
) -> None:
    """Stream tensors into a safetensors file, one at a time, so memory stays at one tensor."""
    code, itemsize = DTYPES[dtype], (4 if dtype == "float32" else 2)
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, shape in zip(names, shapes):
        n = itemsize * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            if dtype == "bfloat16":
                a = _to_bf16_bits(a)
            elif dtype == "float16":
                a = a.astype(np.float16)
            f.write(np.ascontiguousarray(a).tobytes())
        f.flush()
        os.fsync(f.fileno())


STORED_INDEX = "stored.json"


def convert(
    src: Path, dest: Path, *, dtype: str = "float32", progress: bool = False, stored: bool = False
) -> None:
    """Write an mlx-lm folder for GGUF file `src` into the existing, empty directory `dest`.
    With `stored`, the tensors the routed kernel reads as stored (kernels/stored.py) are left
    out of the weights and listed in stored.json, to be read from `src` at load."""
    from tqdm.auto import tqdm

    from ..kernels.stored import readable

    check_dtype(dtype)
    reader = open_reader(Path(src))
    meta = read_metadata(reader)
    architecture(meta)
    plan = _plan(reader)
    shapes = {name: shape for _, name, shape in plan}
    config = model_config(meta, shapes)
    config["torch_dtype"] = dtype
    tokenizer, tok_config = gguf_tokenizer.build(meta, config["max_position_embeddings"])

    dest = Path(dest)
    _write_json(dest / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    _write_json(dest / "generation_config.json", generation)
    tokenizer.save(str(dest / "tokenizer.json"))
    _write_json(dest / "tokenizer_config.json", tok_config)
    if stored:
        kept = [p for p in plan if readable(p[0].tensor_type.name, tuple(p[2]))]
        index = [{"name": n, "tensor": t.name, "type": t.tensor_type.name, "shape": s}
                 for t, n, s in kept]  # fmt: skip
        _write_json(dest / STORED_INDEX, {"tensors": index})
        names = {n for _, n, _ in kept}
        plan = [p for p in plan if p[1] not in names]
    bar = tqdm(plan, desc=f"convert {Path(src).name}", unit="tensor", disable=not progress)
    arrays = _dequantized(bar, config)
    write_safetensors(
        dest / "model.safetensors",
        [n for _, n, _ in plan],
        [s for _, _, s in plan],
        arrays,
        dtype,
    )
    log.info("converted %s (%s, %d tensors) into %s", src, config["model_type"], len(plan), dest)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
