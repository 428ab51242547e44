"""Requests the target writes itself: the draw keeps the top-p set and its renormalised
probabilities, a request does not depend on its batch mates, and the store keeps them with
their answers so a run writes only the missing ones and trains on all of them."""

import json
from dataclasses import replace

import numpy as np
import pytest
from tiny import EOS, byte_tokenizer, tiny_model

from adaspec.train import requests
from adaspec.train.pipeline import grow, plan
from adaspec.train.recipe import Hyper, Recipe, tiny_recipe
from adaspec.train.requests import TOP_K, draw, request_record, sample_requests, user_opening
from adaspec.train.store import ResponseStore


def _logits(probs: dict[int, float], size: int = 300) -> np.ndarray:
    out = np.full(size, -60.0)
    for i, p in probs.items():
        out[i] = np.log(p)
    return out


@pytest.mark.parametrize(
    "probs, want",
    [
        ({7: 0.97, 8: 0.03}, {7: 1.0}),  # the top token alone holds TOP_P
        ({3: 0.6, 9: 0.36, 4: 0.04}, {3: 0.6 / 0.96, 9: 0.36 / 0.96}),
        ({1: 0.5, 2: 0.3, 5: 0.2}, {1: 0.5, 2: 0.3, 5: 0.2}),
    ],
)
def test_a_draw_follows_the_renormalised_top_p_set(probs, want):
    rng = np.random.default_rng(0)
    n = 4000
    got = np.bincount([draw(_logits(probs), rng) for _ in range(n)], minlength=300)
    assert set(np.flatnonzero(got)) == set(want)
    for i, p in want.items():  # within 4 binomial standard deviations
        assert abs(got[i] / n - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1e-9


def test_a_flat_distribution_draws_only_among_the_top_k():
    logits = np.linspace(0.0, 1e-3, 300)  # the highest ids are (barely) the likeliest
    rng = np.random.default_rng(1)
    got = {draw(logits, rng) for _ in range(2000)}
    assert got <= set(range(300 - TOP_K, 300)) and len(got) > TOP_K // 2


def test_a_request_does_not_depend_on_its_batch_mates():
    target, tok = tiny_model("llama", seed=5, scale=1.0), byte_tokenizer()
    opening = user_opening(tok)
    assert opening == [EOS]  # no chat template: a request starts after an end of text
    batch = sample_requests(target, opening, list(range(10, 16)), {EOS})
    assert len({tuple(r) for r in batch}) == len(batch)  # distinct seeds, distinct requests
    assert all(EOS not in r and len(r) <= requests.MAX_REQUEST for r in batch)
    for i in (0, 3):
        assert sample_requests(target, opening, [10 + i], {EOS})[0] == batch[i]


def test_records_are_held_out_by_their_text():
    a, b = request_record(3, "Why is the sea salty?", 0, 0.5), request_record(9, "x", 0, 0.5)
    assert a.id.startswith("self-00003-") and a.source == requests.SOURCE
    assert a == request_record(3, "Why is the sea salty?", 0, 0.5)
    held = [request_record(i, f"request {i}", 0, 0.3).heldout for i in range(400)]
    assert 0.2 < np.mean(held) < 0.4 and b.messages == ({"role": "user", "content": "x"},)


def test_the_store_keeps_written_requests_and_a_rerun_writes_only_the_missing(
    tmp_path, corpus, monkeypatch
):
    target, tok = tiny_model("llama", seed=5, scale=1.0), byte_tokenizer()
    data = tmp_path / "data"
    recipe = tiny_recipe(Recipe(corpus=str(corpus), hyper=Hyper(lr=3e-3)))
    recipe = replace(recipe, respond=0, data=str(data), n_self=5)
    assert plan(target, tok, recipe, data)["self_requests_to_write"] == 5
    grow(target, tok, recipe, data, progress=False)
    fp = json.loads((data / "index.json").read_text())["target"]
    first = {a.id: a for a in ResponseStore(data, fp).load().values()}
    done = set(range(5)) - set(requests.missing(5, ResponseStore(data, fp).load().values()))
    assert done <= set(range(5)) and len(done) >= 4  # an empty request is not kept
    assert plan(target, tok, recipe, data)["self_requests_to_write"] == 5 - len(done)
    for a in first.values():
        assert len(a.response) > 0 and tok.decode(list(a.prompt)).strip()
    asked: list = []
    real = requests.sample_requests

    def spy(model, opening, seeds, eos):
        asked.append(list(seeds))
        return real(model, opening, seeds, eos)

    monkeypatch.setattr(requests, "sample_requests", spy)
    grow(target, tok, replace(recipe, n_self=7), data, progress=False)
    assert asked == [sorted(set(range(7)) - done)]  # seed 0: request i is drawn with seed i
    new = {a.id: a for a in ResponseStore(data, fp).load().values()}
    assert {k: v.key for k, v in first.items()} == {k: new[k].key for k in first}
    summary = plan(target, tok, replace(recipe, n_self=7), data)
    assert summary["stored_answers"] == len(new) >= len(first)
    assert summary["train_sequences"] + summary["heldout_sequences"] == 10 + len(new)
