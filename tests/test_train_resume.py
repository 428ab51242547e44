"""The DFlash pipeline on a tiny random target with a response store: prompts without an answer
train as text, the generation stage alone fills the store, runs (also on a fresh output folder)
train from the stored token ids without generating again, more answers are only the new, and a
shard range chooses which stored answers train."""

import json
from dataclasses import replace

import numpy as np
import pytest
from tiny import byte_tokenizer, tiny_model

from adaspec.train import pipeline
from adaspec.train.pipeline import grow, plan, respond_order, train_dflash
from adaspec.train.recipe import Hyper, Recipe, tiny_recipe


class Stop(Exception):
    pass


def test_a_fresh_run_trains_from_the_stored_responses_without_generating(
    tmp_path, corpus, monkeypatch
):
    target, tok = tiny_model("llama", seed=5, scale=1.0), byte_tokenizer()
    data = tmp_path / "data"
    recipe = tiny_recipe(Recipe(corpus=str(corpus), hyper=Hyper(lr=3e-3)))
    recipe = replace(recipe, respond=4, data=str(data))
    before = plan(target, tok, recipe, data)
    assert before["stored_answers"] == 0 and before["to_answer"] == 4
    assert grow(target, tok, recipe, data, progress=False)["sequences"] == 4
    assert plan(target, tok, recipe, data)["to_answer"] == 0
    # a shard range leaves the answers outside it untrained (their prompts train as text) but
    # does not ask for them again
    other = plan(target, tok, replace(recipe, shards="1-9"), data)
    assert other["to_answer"] == 0 and other["answered_train_sequences"] == 0
    assert other["train_sequences"] + other["heldout_sequences"] == 10
    same = plan(target, tok, replace(recipe, shards="0-0"), data)
    assert (
        same["answered_train_sequences"]
        == plan(target, tok, recipe, data)["answered_train_sequences"]
        > 0
    )

    def no_generation(*args, **kwargs):
        raise AssertionError("generation ran although the store holds every answer")

    monkeypatch.setattr(pipeline, "answer_prompts", no_generation)
    first = train_dflash(target, tok, tmp_path / "a", recipe, progress=False)
    d = first["data"]
    index = json.loads((data / "index.json").read_text())
    assert d["prompts"] == 10 and index["sequences"] == 4
    # the 6 prompts without an answer train as text: every position has a first label
    assert d["answered_train_sequences"] < d["train_sequences"]
    depth = d["labels_by_depth"]
    positions = d["train_prompt_tokens"] + d["train_response_tokens"] - d["train_sequences"]
    assert depth[0] == positions and 0 < depth[-1] < depth[1] < depth[0]
    assert np.isfinite(first["evals"][-1]["text_accept1"])
    assert d["train_first_labels"] == before["train_first_labels"] + d["train_response_tokens"]

    # a fresh output folder (no features, no state) trains from the same stored answers
    soft = replace(recipe, hyper=replace(recipe.hyper, soft=0.5, vocab="data"))
    second = train_dflash(target, tok, tmp_path / "b", soft, progress=False)
    assert second["data"] == first["data"]
    losses = [v for _, v in second["loss"]]
    assert np.all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3])

    # asking for two more answers generates exactly the next two prompts in answer order
    asked = []

    def record(model, eos, todo, store, **kwargs):
        asked.extend(p for p, _ in todo)
        raise Stop

    monkeypatch.setattr(pipeline, "answer_prompts", record)
    with pytest.raises(Stop):
        train_dflash(target, tok, tmp_path / "c", replace(recipe, respond=6), progress=False)
    prompts = pipeline._prompts(tmp_path / "c" / "work", recipe)
    assert [p.id for p in asked] == [p.id for p in respond_order(prompts)[4:6]]
