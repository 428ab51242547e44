"""Tier 1-2: a forward handed to mlx's stream in pieces (CacheTarget.pieces) computes the same
bits as one handed over whole, and leaves the model's layer list as it found it."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiny import VOCAB, tiny_model
from tiny_recurrent import tiny_hybrid

from adaspec.settings import Settings
from adaspec.targets import make_target
from adaspec.targets.base import handoff_layers, layer_list

MODELS = {"llama": tiny_model("llama"), "qwen3": tiny_model("qwen3")}
MODELS["qwen3_next"] = tiny_hybrid("qwen3_next")


@given(layers=st.integers(1, 80), pieces=st.integers(1, 300))
def test_handoffs_split_the_layers_into_the_pieces_asked_for(layers, pieces):
    got = handoff_layers(layers, pieces)
    assert len(got) == min(pieces, layers) - 1
    assert got == sorted(set(got)) and all(0 <= i < layers - 1 for i in got)
    bounds = [-1, *got, layers - 1]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert max(sizes) - min(sizes) <= 1  # nearly equal pieces


def run(model, pieces, prompt, fed, taps):
    t = make_target(model, pieces=pieces)
    feats = t.prefill(prompt, taps)
    out = t.forward(fed, taps)
    mx.eval(out.logits, feats, out.features)
    return np.array(out.logits), np.array(feats), np.array(out.features)


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("pieces", [2, 3, 64])
def test_pieces_give_the_same_bits_and_restore_the_layers(arch, pieces):
    model = MODELS[arch]
    layers = list(layer_list(model))
    prompt, fed = [3, 1, 4, 1, 5, 9, 2], [6, 5 % VOCAB, 3]
    taps = (0, len(layers) - 1)
    whole = run(model, 1, prompt, fed, taps)
    split = run(model, pieces, prompt, fed, taps)
    for a, b in zip(whole, split):
        assert a.tobytes() == b.tobytes()
    assert layer_list(model) == layers


def test_layers_are_restored_when_the_forward_raises():
    model = MODELS["llama"]
    layers = list(layer_list(model))
    t = make_target(model, pieces=2)
    with pytest.raises(ValueError):
        t.forward(mx.zeros((2, 2), dtype=mx.uint32))  # not a token list
    assert layer_list(model) == layers


def test_the_setting_names_value_and_range():
    assert Settings().forward_pieces == 10
    with pytest.raises(Exception, match="ADASPEC_FORWARD_PIECES=0"):
        Settings(forward_pieces=0)
