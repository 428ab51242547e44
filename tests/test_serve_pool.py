"""Tier 1: the server's prompt-cache pool policy and the flags `adaspec serve` refuses."""

from types import SimpleNamespace

import pytest

from adaspec.cli import main
from adaspec.serve import CachePool, check_drafter


def cache(tokens, policy=None):
    return SimpleNamespace(tokens=list(tokens), policy=policy)


def new():
    return cache([], policy="prior")


def test_pool_continues_a_conversation_and_keeps_the_others():
    pool = CachePool(3)
    a, b = cache([1, 2, 3, 4]), cache([1, 2, 9, 9, 9])
    pool.give("pld", a)
    pool.give("pld", b)
    assert pool.take("pld", [1, 2, 3, 4, 5], lambda: "new") is a  # continuation
    assert pool.take("pld", [1, 2, 7], new) not in (a, b)  # room left: b is kept
    assert pool.take("none", [1, 2, 9, 9, 9, 1], new) not in (a, b)  # other drafter
    assert [c for _, c in pool.entries] == [b]


def test_pool_is_bounded_by_count_and_bytes_when_given_back():
    def sized(n):
        kv = SimpleNamespace(nbytes=n)
        return SimpleNamespace(tokens=[n], policy=None, target=SimpleNamespace(cache=[kv, kv]))

    pool = CachePool(3, max_bytes=100)
    for n in (10, 20, 30):
        pool.give("pld", sized(n))
    assert pool.nbytes() == 100 and len(pool.entries) == 2  # the oldest (2 x 10 bytes) went
    pool.give("pld", sized(500))  # alone over the budget: kept, the others dropped
    assert [c.tokens for _, c in pool.entries] == [[500]]
    unbounded = CachePool(2)
    for n in (1, 2, 3):  # requests decoded together give back more caches than it holds
        unbounded.give("pld", sized(n))
    assert [c.tokens for _, c in unbounded.entries] == [[2], [3]]


def test_full_pool_rolls_back_the_longest_prefix_or_drops_the_oldest():
    pool = CachePool(2)
    a, b = cache([1, 2, 3]), cache([1, 5, 6])
    pool.give("pld", a)
    pool.give("pld", b)
    assert pool.take("pld", [1, 5, 0], lambda: "new") is b
    pool.give("dflash", cache([4]))
    assert pool.take("none", [1], new) not in (a, b)
    assert [s for s, _ in pool.entries] == ["dflash"]  # the oldest (a) made room


def test_a_new_cache_starts_from_a_copy_of_the_last_policy_of_its_drafter():
    pool = CachePool(4)
    assert pool.take("pld", [1, 2], new).policy == "prior"  # nothing measured yet
    pool.give("pld", cache([1, 2], policy={"accept": [0.9]}))
    pool.give("pld", cache([3, 4], policy={"accept": [0.7]}))
    pool.give("dflash", cache([5], policy={"accept": [0.2]}))
    got = pool.take("pld", [8, 9, 9, 9], new)
    assert got.policy == {"accept": [0.7]}  # the latest pld cache's
    got.policy["accept"].append(0.5)  # a copy: the donor's policy is left alone
    assert pool.entries[1][1].policy == {"accept": [0.7]}
    assert pool.take("none", [8], new).policy == "prior"
    pool.clear()  # a model change forgets what was measured
    assert pool.take("pld", [8], new).policy == "prior"


@pytest.mark.parametrize("spec", ["nope", "pld+nope", "pld:bad=1,"])
def test_bad_drafter_spec_names_drafter(spec):
    with pytest.raises(ValueError, match="drafter="):
        check_drafter(spec)


def test_serve_refuses_flags_it_does_not_read(capsys):
    assert main(["serve", "--kv-bits", "4", "--decode-concurrency", "4"]) == 2
    err = capsys.readouterr().err
    assert "--kv-bits" in err and "--decode-concurrency" in err
