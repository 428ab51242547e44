"""Tier 2: requests decoded together (serve/batch.py) on tiny models. Random arrivals and
hang-ups, random drafts (oracle, corrupt, random, prompt lookup), greedy and sampled requests
side by side: each greedy request's tokens equal its solo run's, a request that stops early
has received a prefix of them, and the batch never feeds more rows than the exact kernel
takes."""

import math

import pytest
from drafters_for_tests import ScriptedDrafter
from hypothesis import given
from hypothesis import strategies as st

from adaspec.api import start_decoder, stream_generate
from adaspec.kernels import blas
from adaspec.policy.batch_budget import observe_rows, row_curve, split
from adaspec.serve.batch import Batch, join
from adaspec.targets import make_target
from adaspec.targets.batch import MAX_ROWS, shared_unsupported

MODES = st.sampled_from(["oracle", "corrupt", "random", "none"])
PROGRAM = st.lists(st.tuples(MODES, st.integers(0, 12), st.integers(0, 99)), min_size=1, max_size=5)


@st.composite
def requests(draw):
    n = draw(st.integers(1, 6))
    out = []
    for _ in range(n):
        out.append(
            dict(
                prompt=draw(
                    st.lists(st.sampled_from([97, 98, 99, 32, 100]), min_size=2, max_size=16)
                ),
                max_tokens=draw(st.integers(1, 20)),
                arrive=draw(st.integers(0, 6)),
                hang_up=draw(st.one_of(st.none(), st.integers(1, 10))),
                drafter=draw(st.one_of(st.just("pld"), PROGRAM)),
                temp=draw(st.sampled_from([0.0, 0.0, 0.8])),
                seed=draw(st.integers(0, 1000)),
            )
        )
    return out


def _solo(model, tok, r) -> list[int]:
    """The request's greedy tokens served alone (plain AR; every drafter gives the same)."""
    return [x.token for x in stream_generate(model, tok, r["prompt"], max_tokens=r["max_tokens"])]


def _drafter(r, reference):
    if r["drafter"] == "pld":
        return "pld"
    return [ScriptedDrafter(r["drafter"], reference, len(r["prompt"]), 256)]


def _serve_together(model, tok, reqs, refs) -> tuple[list[list[int]], Batch]:
    batch, got = Batch(), [[] for _ in reqs]
    waiting = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrive"])
    step = 0
    while waiting or batch.members:
        while waiting and reqs[waiting[0]]["arrive"] <= step:
            i = waiting.pop(0)
            r = reqs[i]

            def emit(resp, i=i, hang=r["hang_up"]):
                got[i].append(resp.token)
                return resp.finish_reason is not None or len(got[i]) == hang

            dec, ids = start_decoder(
                model, tok, r["prompt"], drafter=_drafter(r, refs[i]), max_tokens=r["max_tokens"],
                temp=r["temp"], seed=r["seed"], shared_forward=True,
            )  # fmt: skip
            batch.add(join(dec, ids, tok, emit))
        if batch.members:
            batch.step()
            assert batch.rows_fed <= batch.steps * MAX_ROWS
        step += 1
    return got, batch


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def twins(request):
    """A tiny model with the layer twins: the batch's forwards take the shared attention path
    (the native nodes of kernels/native_layers.py)"""
    from tiny import tiny_model

    from adaspec.kernels import layers

    model = tiny_model(request.param)
    layers.install(model)
    return model


@given(reqs=requests())
def test_greedy_requests_served_together_equal_their_solo_runs(tiny, tokenizer, reqs):
    _check_against_solo(tiny, tokenizer, reqs)


@given(reqs=requests())
def test_requests_on_the_shared_attention_path_equal_their_solo_runs(twins, tokenizer, reqs):
    if not blas.routed():
        pytest.skip("the shared path needs the routed GEMM kernel")
    assert shared_unsupported(twins, [make_target(twins)]) == ""
    _check_against_solo(twins, tokenizer, reqs)


def _check_against_solo(model, tokenizer, reqs) -> None:
    refs = [_solo(model, tokenizer, r) for r in reqs]
    got, _ = _serve_together(model, tokenizer, reqs, refs)
    for r, ref, g in zip(reqs, refs, got):
        if r["temp"] == 0:
            n = len(ref) if r["hang_up"] is None else min(len(ref), r["hang_up"])
            assert g == ref[:n], (r, ref, g)
        else:
            assert 1 <= len(g) <= r["max_tokens"] and all(0 <= t < 260 for t in g)


def test_sampled_request_alone_in_the_batch_is_reproducible(tiny, tokenizer):
    r = dict(prompt=[97, 98, 97, 98], max_tokens=12, arrive=0, hang_up=None, drafter="pld",
             temp=0.8, seed=5)  # fmt: skip
    a, _ = _serve_together(tiny, tokenizer, [r], [[]])
    b, _ = _serve_together(tiny, tokenizer, [r], [[]])
    assert a == b and len(a[0]) >= 1


@given(
    gains=st.lists(
        st.lists(st.floats(0, 1), max_size=12).map(lambda g: sorted(g, reverse=True)),
        min_size=1,
        max_size=8,
    ),
    slope=st.floats(0.0, 0.5),
)
def test_split_keeps_within_rows_and_drafts_and_beats_no_drafts(gains, slope):
    cost = [1.0] + [1 + slope * m for m in range(1, MAX_ROWS + 1)]
    k = split(gains, cost, MAX_ROWS)
    n = len(gains)
    assert all(0 <= ki <= len(g) for ki, g in zip(k, gains))
    assert n + sum(k) <= MAX_ROWS
    rate = (n + sum(sum(g[:ki]) for g, ki in zip(gains, k))) / cost[n + sum(k)]
    assert rate >= n / cost[n] - 1e-12


def test_split_drops_drafts_that_do_not_pay_in_a_full_batch():
    one_draft = split([[0.3] * 4], [1.0] + [1 + 0.06 * m for m in range(1, 33)], 32)
    assert one_draft == [4]  # alone, four 0.3-tokens pay for their rows
    steep = [1.0] + [1 + 0.5 * m for m in range(1, 33)]
    assert split([[0.3] * 4] * 8, steep, 32) == [0] * 8  # in a costly batch they do not


def test_row_cost_interpolates_measured_counts():
    assert row_curve((), 8)[1] == 1.06 and len(row_curve((), 8)) == 9
    c = observe_rows(observe_rows((), 1, 1.0), 5, 2.0)
    curve = row_curve(c, 8)
    assert curve[1] == 1.0 and curve[5] == 2.0 and math.isclose(curve[3], 1.5)
    assert curve[8] > 2.0
    assert math.isclose(row_curve(observe_rows(c, 5, 4.0), 8)[5], 2.4)  # an EMA, weight 0.2


def test_oracle_drafts_are_accepted_in_a_shared_forward(tiny, tokenizer):
    reqs = [
        dict(prompt=[97 + i, 98, 99], max_tokens=16, arrive=i, hang_up=None,
             drafter=[("oracle", 6, 0)], temp=0.0, seed=0)
        for i in range(3)
    ]  # fmt: skip
    refs = [_solo(tiny, tokenizer, r) for r in reqs]
    got, batch = _serve_together(tiny, tokenizer, reqs, refs)
    assert got == refs
    # several requests per forward, several rows per request: fewer steps than tokens
    assert batch.rows_fed > 2 * batch.steps and batch.steps < sum(map(len, refs)) / 2


def test_a_broken_drafter_ends_its_own_request_only(tiny, tokenizer):
    from adaspec.errors import DrafterError

    good = dict(prompt=[97, 98, 99, 97], max_tokens=12, arrive=0, hang_up=None,
                drafter=[("oracle", 3, 0)], temp=0.0, seed=0)  # fmt: skip
    bad = {**good, "prompt": [98, 99], "drafter": [("overlong", 2, 0)]}
    reqs = [good, bad, {**good, "prompt": [100, 32, 97]}]
    refs = [_solo(tiny, tokenizer, r) for r in reqs]
    batch, got, errors = Batch(), [[] for _ in reqs], []
    for i, r in enumerate(reqs):
        dec, ids = start_decoder(
            tiny, tokenizer, r["prompt"], drafter=_drafter(r, refs[i]),
            max_tokens=r["max_tokens"], shared_forward=True,
        )  # fmt: skip
        batch.add(join(dec, ids, tokenizer, lambda x, i=i: got[i].append(x.token) or False))
    while batch.members:
        errors += [m.error for m in batch.step() if m.error is not None]
    assert len(errors) == 1 and isinstance(errors[0], DrafterError)
    assert got[0] == refs[0] and got[2] == refs[2]
    assert got[1] == refs[1][: len(got[1])]


def test_a_finished_request_is_freed_without_the_cyclic_collector(tiny, tokenizer):
    """The server's request object holds its member and the member calls back into it; once
    the request is done nothing may keep its decoder (and KV cache) alive but a gc pass."""
    import gc
    import weakref

    class Request:  # as serve/generator.py's: holds the member, the member calls its emit
        def emit(self, r):
            return r.finish_reason is not None

    batch, refs, requests_ = Batch(), [], []
    gc.disable()
    try:
        for i in range(3):
            dec, ids = start_decoder(
                tiny, tokenizer, [97, 98, 99 + i], drafter="pld", max_tokens=5 + i,
                shared_forward=True,
            )  # fmt: skip
            refs.append(weakref.ref(dec))
            r = Request()
            r.member = join(dec, ids, tokenizer, r.emit)
            batch.add(r.member)
            requests_.append(r)
            del dec, r
        while batch.members:
            batch.step()
        requests_.clear()
        assert [ref() for ref in refs] == [None, None, None]
    finally:
        gc.enable()
