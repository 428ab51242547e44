"""Tier 2: DFlash checkpoints: save/load round trip in z-lab's format, and bad checkpoints and
arguments rejected with messages that name the value and what is accepted."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from tiny import VOCAB, tiny_model
from tiny_dflash import ctx, tiny_drafter

from adaspec import settings as settings_mod
from adaspec.drafters import dflash
from adaspec.drafters.arms import make
from adaspec.errors import DrafterError, DrafterMismatchError, ModelLoadError
from adaspec.targets.base import target_info

TARGETS = {a: tiny_model(a) for a in ("llama", "qwen3")}
FEATS = np.random.default_rng(7).normal(size=(20, 128)).astype(np.float32)


# ---- (d) save / load round trip -----------------------------------------------------------


def test_save_load_round_trip_gives_identical_drafts(tmp_path):
    target = TARGETS["qwen3"]
    d = tiny_drafter(
        target,
        seed=3,
        block=6,
        layer_types=("full_attention", "sliding_attention"),
        sliding_window=4,
    )
    d.save(tmp_path / "f32")
    info = target_info(target)
    loaded = make(f"dflash:{tmp_path / 'f32'}", info, settings_mod.from_env({}))
    assert loaded.block == 6 and loaded.cfg.layer_types == d.cfg.layer_types
    for x in (d, loaded):
        x.prefill(list(range(10)), ctx(range(10), FEATS[:9]))
    np.testing.assert_array_equal(np.array(loaded.block_logits(5)), np.array(d.block_logits(5)))
    assert loaded.draft(ctx(loaded.tokens)) == d.draft(ctx(d.tokens))
    # fp16 storage: same format, loads back to float32 compute, close logits
    d.save(tmp_path / "f16", dtype="float16")
    cfg = json.loads((tmp_path / "f16" / "config.json").read_text())
    assert cfg["dflash_config"] == {
        "block_size": 6,
        "target_layer_ids": [0, 1],
        "mask_token_id": VOCAB - 1,
    }
    half = dflash.load(tmp_path / "f16", info, block=3)
    assert half.block == 3 and half.model.fc.weight.dtype == mx.float32


def test_drafters_from_one_folder_share_weights_until_the_files_change(tmp_path):
    target = TARGETS["llama"]
    info = target_info(target)
    tiny_drafter(target, seed=3).save(tmp_path / "a")
    one, two = dflash.load(tmp_path / "a", info), dflash.load(tmp_path / "a", info, block=3)
    assert one.model is two.model and one.cache is not two.cache
    one.prefill(list(range(10)), ctx(range(10), FEATS[:9]))
    assert two.tokens == [] and two.cache.length == 0  # contexts stay apart
    tiny_drafter(target, seed=4).save(tmp_path / "a")  # rewritten: read again
    three = dflash.load(tmp_path / "a", info)
    assert three.model is not one.model
    assert not np.array_equal(np.array(three.model.fc.weight), np.array(one.model.fc.weight))


# ---- (g) bad checkpoints and arguments are rejected with clear messages --------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("dflash") / "ok"
    tiny_drafter(TARGETS["llama"]).save(path)
    return path


def _variant(ckpt, tmp_path, config=None, weights=None):
    out = tmp_path / "bad"
    shutil.copytree(ckpt, out)
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        w = dict(mx.load(str(out / "model.safetensors")))
        weights(w)
        mx.save_safetensors(str(out / "model.safetensors"), w)
    return out


def _set(**kv):
    return lambda d: d.update(kv)


def _set_dflash(**kv):
    return lambda d: d["dflash_config"].update(kv)


def _pop(key):
    return lambda d: d.pop(key)


BAD_CONFIGS = [
    (_set(vocab_size=300), DrafterMismatchError, "vocab_size=300 .*vocab_size 260"),
    (_set(hidden_size=32), DrafterMismatchError, "hidden_size=32 .*hidden_size 64"),
    (_set(num_target_layers=5), DrafterMismatchError, "num_target_layers=5"),
    (_set_dflash(target_layer_ids=[0, 2]), DrafterMismatchError, r"\[2\] are out of range.*0..1"),
    (_set(layer_types=["full_attention", "mamba"]), DrafterError, r"layer_types \['mamba'\]"),
    (
        _set(layer_types=["sliding_attention"] * 2, sliding_window=None),
        DrafterError,
        "sliding_window=None",
    ),
    (_set(layer_types=["full_attention"]), DrafterError, "layer_types of length 1"),
    (_set_dflash(mask_token_id=999), DrafterError, r"mask_token_id=999 .*0..259"),
    (_set_dflash(block_size=1), DrafterError, "block_size=1"),
    (_set(num_key_value_heads=3), DrafterError, "divisible"),
    (_set(num_key_value_heads=0), DrafterError, "num_key_value_heads=0 .*positive integer"),
    (_set(architectures=["DFlash2DraftModel"]), DrafterError, "'DFlash2DraftModel' is not"),
    (_pop("hidden_size"), ModelLoadError, "lacks hidden_size"),
    (_pop("dflash_config"), ModelLoadError, "lacks dflash_config.target_layer_ids"),
    (_set(hidden_size="big"), ModelLoadError, "wrong type"),
]


@pytest.mark.parametrize("mutate,exc,msg", BAD_CONFIGS)
def test_bad_config_rejected(ckpt, tmp_path, mutate, exc, msg):
    with pytest.raises(exc, match=msg):
        dflash.load(_variant(ckpt, tmp_path, config=mutate), target_info(TARGETS["llama"]))


BAD_WEIGHTS = [
    (lambda w: w.pop("layers.1.mlp.up_proj.weight"), "missing weight keys layers.1.mlp.up_proj"),
    (lambda w: w.update(extra=mx.zeros(3)), "unexpected weight keys extra"),
    (
        lambda w: w.update({"fc.weight": mx.zeros((64, 64))}),
        r"fc.weight has shape \(64, 64\); accepted: \(64, 128\)",
    ),
]


@pytest.mark.parametrize("mutate,msg", BAD_WEIGHTS)
def test_bad_weights_rejected(ckpt, tmp_path, mutate, msg):
    with pytest.raises(ModelLoadError, match=msg):
        dflash.load(_variant(ckpt, tmp_path, weights=mutate), target_info(TARGETS["llama"]))


def test_missing_files_rejected(ckpt, tmp_path):
    info = target_info(TARGETS["llama"])
    with pytest.raises(ModelLoadError, match="does not exist"):
        dflash.load(tmp_path / "nope", info)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        dflash.load(tmp_path / "empty", info)
    out = _variant(ckpt, tmp_path)
    (out / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        dflash.load(out, info)
    (out / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        dflash.load(out, info)


def test_factory_arguments(ckpt):
    info = target_info(TARGETS["llama"])
    s = settings_mod.from_env({"ADASPEC_DFLASH_BLOCK": "4", "ADASPEC_DFLASH_CTX_WINDOW": "64"})
    d = make(f"dflash:{ckpt}", info, s)
    assert (d.block, d.window, d.sink) == (4, 64, 4)
    d = make(f"dflash:{ckpt},block=3,window=16,sink=0", info, s)
    assert (d.block, d.window, d.sink) == (3, 16, 0)
    with pytest.raises(
        DrafterError, match=r"dflash argument blok='3' is invalid; accepted: block=<int>"
    ):
        make(f"dflash:{ckpt},blok=3", info, s)
    with pytest.raises(DrafterError, match="block=1 is invalid"):
        make(f"dflash:{ckpt},block=1", info, s)
    with pytest.raises(DrafterError, match="window=8, sink=8 are invalid"):
        make(f"dflash:{ckpt},window=8,sink=8", info, s)
    with pytest.raises(DrafterError, match="needs a DFlash checkpoint folder"):
        make("dflash", info, s)
    with pytest.raises(DrafterError, match="needs a DFlash checkpoint folder"):
        make("dflash:block=4", info, s)
