"""DFlash checkpoints in z-lab's format (config.json + *.safetensors): validation against the
config and the target, load and save. One optional tensor is adaspec's own: `head_token_ids`,
the token set a restricted draft head proposes from (restricted_head.py)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..errors import DrafterError, DrafterMismatchError, ModelLoadError
from ..targets.base import TargetInfo
from .dflash_model import DFlashConfig, DFlashModel
from .restricted_head import HEAD_KEY, check_head_tokens

log = logging.getLogger(__name__)


def expected_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    d, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kvd = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = {
        "fc.weight": (d, len(cfg.target_layer_ids) * d),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
    }
    per_layer = {
        "self_attn.q_proj.weight": (qd, d),
        "self_attn.k_proj.weight": (kvd, d),
        "self_attn.v_proj.weight": (kvd, d),
        "self_attn.o_proj.weight": (d, qd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (ff, d),
        "mlp.up_proj.weight": (ff, d),
        "mlp.down_proj.weight": (d, ff),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    for i in range(cfg.num_hidden_layers):
        out.update({f"layers.{i}.{k}": s for k, s in per_layer.items()})
    return out


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:6]) + (f" (+{len(keys) - 6} more)" if len(keys) > 6 else "")


def check_weights(weights: dict[str, mx.array], cfg: DFlashConfig, where: str) -> None:
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    if missing or extra:
        raise ModelLoadError(
            f"DFlash checkpoint {where}: "
            + "; ".join(
                s
                for s in (
                    f"missing weight keys {_names(missing)}" if missing else "",
                    f"unexpected weight keys {_names(extra)}" if extra else "",
                )
                if s
            )
            + "; accepted: exactly the z-lab DFlash keys for the config (fc, hidden_norm, "
            "layers.N.self_attn/mlp/layernorms, norm)"
        )
    for k, shape in want.items():
        if tuple(weights[k].shape) != shape:
            raise ModelLoadError(
                f"DFlash checkpoint {where}: weight {k} has shape {tuple(weights[k].shape)}; "
                f"accepted: {shape} for this config.json"
            )


def check_target(cfg: DFlashConfig, info: TargetInfo) -> None:
    """Raise DrafterMismatchError if the drafter cannot run on this target."""

    def mismatch(what: str, value: object, target: object) -> DrafterMismatchError:
        return DrafterMismatchError(
            f"DFlash drafter {what}={value} does not fit the target ({info.model_type or '?'}, "
            f"{what} {target}); accepted: a drafter trained for this target"
        )

    if cfg.vocab_size != info.vocab_size:
        raise mismatch("vocab_size", cfg.vocab_size, info.vocab_size)
    if cfg.hidden_size != info.hidden_size:
        raise mismatch("hidden_size", cfg.hidden_size, info.hidden_size)
    if cfg.num_target_layers is not None and cfg.num_target_layers != info.num_layers:
        raise mismatch("num_target_layers", cfg.num_target_layers, info.num_layers)
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < info.num_layers]
    if bad:
        raise DrafterMismatchError(
            f"DFlash target_layer_ids {bad} are out of range for the target's "
            f"{info.num_layers} layers; accepted: 0..{info.num_layers - 1}"
        )


def read_checkpoint(
    path: str | Path, info: TargetInfo | None = None
) -> tuple[DFlashConfig, dict[str, mx.array], np.ndarray | None]:
    """Config, weights and the head's token set (None: the full vocabulary), validated; with
    `info`, the config is checked against the target before any weight is read (a drafter for
    another model is the likelier mistake)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelLoadError(
            f"DFlash checkpoint folder {str(p)!r} does not exist; accepted: a "
            "folder with config.json and *.safetensors"
        )
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"DFlash checkpoint {str(p)!r} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"DFlash config {str(cfg_file)!r} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"DFlash config {str(cfg_file)!r} is not a JSON object")
    cfg = DFlashConfig.from_dict(raw)
    if info is not None:
        check_target(cfg, info)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"DFlash checkpoint {str(p)!r} has no *.safetensors weight file")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(cast(dict, mx.load(str(f))))
        except Exception as exc:  # mlx raises bare RuntimeError/ValueError on broken files
            raise ModelLoadError(f"cannot read DFlash weights {str(f)!r}: {exc}") from None
    stored_head = weights.pop(HEAD_KEY, None)
    check_weights(weights, cfg, repr(str(p)))
    head = None
    if stored_head is not None:
        head = check_head_tokens(stored_head, cfg.vocab_size, f"DFlash checkpoint {str(p)!r}")
    return cfg, weights, head


def load_model(path: str | Path, info: TargetInfo | None = None) -> DFlashModel:
    """Read a z-lab-format checkpoint; computation runs in float32 whatever the stored dtype."""
    cfg, weights, head = read_checkpoint(path, info)
    model = DFlashModel(cfg)
    model.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()], strict=True)
    model.head_token_ids = head
    mx.eval(model.parameters())
    log.info(
        "loaded DFlash drafter %s: %d layers, block %d, head over %s tokens",
        path,
        cfg.num_hidden_layers,
        cfg.block_size,
        cfg.vocab_size if head is None else len(head),
    )
    return model


def save_model(
    model: DFlashModel,
    path: str | Path,
    dtype: str = "float32",
    head_token_ids: np.ndarray | None = None,
) -> Path:
    """Write config.json + model.safetensors in z-lab's format (dtype: float32/float16/bfloat16).
    head_token_ids (most frequent first, e.g. from `select_head_tokens`), or else the model's
    own set, is written as an int32 tensor; without either the head is the full vocabulary."""
    if dtype not in ("float32", "float16", "bfloat16"):
        raise DrafterError(f"save dtype {dtype!r} is invalid; accepted: float32, float16, bfloat16")
    head = model.head_token_ids if head_token_ids is None else head_token_ids
    if head is not None:
        head = check_head_tokens(head, model.cfg.vocab_size, "save_model")
    p = Path(path).expanduser()
    p.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg.to_dict()
    cfg["torch_dtype"] = dtype
    (p / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in flat}
    if head is not None:
        weights[HEAD_KEY] = mx.array(head)
    mx.save_safetensors(str(p / "model.safetensors"), weights, metadata={"format": "pt"})
    return p


def write_head_tokens(path: str | Path, head_token_ids: np.ndarray | None) -> Path:
    """Add, replace (or with None remove) the head token set of an existing checkpoint folder,
    e.g. a z-lab drafter's, leaving its config and weights as they are."""
    p = Path(path).expanduser()
    cfg, _, _ = read_checkpoint(p)
    files = sorted(p.glob("*.safetensors"))
    target = next((f for f in files if HEAD_KEY in cast(dict, mx.load(str(f)))), files[0])
    weights, meta = cast(tuple[dict, dict], mx.load(str(target), return_metadata=True))
    weights.pop(HEAD_KEY, None)
    if head_token_ids is not None:
        where = f"DFlash checkpoint {str(p)!r}"
        weights[HEAD_KEY] = mx.array(check_head_tokens(head_token_ids, cfg.vocab_size, where))
    mx.eval(list(weights.values()))  # read everything before the file is replaced
    with tempfile.TemporaryDirectory(dir=p) as tmp:  # mlx appends .safetensors to any name
        new = Path(tmp) / target.name
        mx.save_safetensors(str(new), weights, metadata=meta or {"format": "pt"})
        os.replace(new, target)
    return p
