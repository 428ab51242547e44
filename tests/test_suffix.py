"""The suffix drafter: its index agrees with a brute-force search, drafting follows the counts,
the drafter's state follows commits and rollbacks, greedy output stays the target's, the online
part grows within its bound and persists, and bad input is refused naming the value."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tiny import ar_greedy, tiny_model

from adaspec import settings as settings_mod
from adaspec.drafters import suffix_store
from adaspec.drafters.arms import make
from adaspec.drafters.base import Draft, DraftContext
from adaspec.drafters.pld import PromptLookup
from adaspec.drafters.suffix import SuffixDrafter, context_match
from adaspec.drafters.suffix_index import SEP, SuffixIndex, pack, walk
from adaspec.drafters.suffix_store import Library, load_data, save_data
from adaspec.errors import DrafterError
from adaspec.loop.controller import AlwaysSpeculate, DecodeConfig, Decoder, decode
from adaspec.policy.adaptive import GatedPolicy, PolicyConfig
from adaspec.targets.base import TargetInfo, target_info
from adaspec.targets.kv import KVTarget

tok = st.integers(0, 3)  # a tiny alphabet: repeats (and long matches) are common
seqs = st.lists(st.lists(tok, min_size=1, max_size=25), min_size=1, max_size=6)


def brute_match(sequences, context, depth):
    """Longest suffix of context (<= depth) found in a sequence, and the forward positions (in
    the packed stream) of the token after each of its occurrences."""
    stream = pack(sequences).tolist()
    for n in range(min(depth, len(context)), 0, -1):
        pat = list(context[len(context) - n :])
        hits = [i + n for i in range(len(stream) - n + 1) if stream[i : i + n] == pat]
        if hits:
            return n, sorted(hits)
    return 0, []


@settings(max_examples=150)
@given(seqs, st.lists(tok, min_size=1, max_size=12), st.integers(1, 9))
def test_match_and_continuations_equal_a_brute_force_search(sequences, context, depth):
    index = SuffixIndex.build(sequences, depth)
    m = index.match(context)
    n, hits = brute_match(sequences, context, depth)
    assert m.length == n
    assert sorted(index.continuations(m).tolist()) == hits


def brute_chain(sequences, context, depth, k, min_prob, prior=1.0):
    """The chain walk by hand: the most frequent next token (ties: smallest id) over the
    occurrences still matching, while the product of count / (total + prior) stays >= min_prob."""
    stream = pack(sequences).tolist()
    n, pos = brute_match(sequences, context, depth)
    out, p = [], 1.0
    while pos and len(out) < k:
        nxt = [stream[q] for q in pos]
        counts = {t: nxt.count(t) for t in set(nxt) if t != SEP}
        if not counts:
            break
        t = min(counts, key=lambda x: (-counts[x], x))
        f = counts[t] / (len(nxt) + prior)
        if p * f < min_prob:
            break
        p *= f
        out.append(t)
        pos = [q + 1 for q in pos if stream[q] == t]
    return tuple(out)


@settings(max_examples=150)
@given(
    seqs,
    st.lists(tok, min_size=1, max_size=10),
    st.integers(1, 8),
    st.integers(1, 10),
    st.sampled_from([0.0, 0.05, 0.2, 0.5]),
)
def test_the_chain_follows_the_most_frequent_continuation(sequences, context, depth, k, min_prob):
    index = SuffixIndex.build(sequences, depth)
    m = index.match(context)
    w = walk([(index.tokens, index.continuations(m))], k, min_prob) if m.count else None
    got = w.tokens if w else ()
    assert got == brute_chain(sequences, context, depth, k, min_prob)
    if w and w.probs:
        assert list(w.probs) == sorted(w.probs, reverse=True) and w.probs[-1] >= min_prob


@settings(max_examples=100)
@given(seqs, st.lists(tok, min_size=1, max_size=10), st.integers(1, 12), st.integers(1, 6))
def test_a_tree_holds_the_chain_as_its_first_children(sequences, context, nodes, k):
    index = SuffixIndex.build(sequences, 8)
    m = index.match(context)
    if not m.count:
        return
    streams = [(index.tokens, index.continuations(m))]
    tree = walk(streams, k, 0.0, nodes)
    chain = walk(streams, k, 0.0)
    d = Draft(tree.tokens, parents=tree.parents) if tree.tokens else Draft()
    assert len(d) <= nodes and max(d.depths(), default=0) <= k
    best = d.best_chain().tokens
    assert best == chain.tokens[: len(best)]


@given(st.lists(tok, min_size=1, max_size=40), st.integers(1, 8))
def test_context_match_equals_a_brute_force_search(tokens, depth):
    length, pos = context_match(np.array(tokens, np.int32), depth)
    L = len(tokens)
    want = (0, [])
    for n in range(min(depth, L - 1), 0, -1):
        hits = [i + n for i in range(L - n) if tokens[i : i + n] == tokens[L - n :]]
        if hits:
            want = (n, hits)
            break
    assert (length, sorted(pos.tolist())) == want


def drafter(sequences=(), **kw):
    lib = Library(SuffixIndex.build(sequences, 16) if sequences else None, 16, 0)
    return SuffixDrafter(lib, learn=False, **kw)


class SuffixMachine(RuleBasedStateMachine):
    """Any prefill/advance/rollback program: the view is the committed list, and a draft is
    what a fresh drafter prefilled with that list proposes."""

    @initialize(data=seqs, prompt=st.lists(tok, min_size=1, max_size=20))
    def start(self, data, prompt):
        self.data = data
        self.d = drafter(data)
        self.d.prefill(prompt, DraftContext(prompt, 0))
        self.model = list(prompt)

    @rule(tokens=st.lists(tok, min_size=1, max_size=6))
    def advance(self, tokens):
        self.d.advance(tokens, DraftContext(self.model, 0))
        self.model += tokens

    @rule(data=st.data())
    def rollback(self, data):
        n = data.draw(st.integers(0, len(self.model) - 1))
        self.d.rollback(n)
        del self.model[len(self.model) - n :]

    @invariant()
    def drafts_like_a_fresh_drafter(self):
        if hasattr(self, "d"):
            assert self.d.tokens == self.model
            fresh = drafter(self.data)
            fresh.prefill(self.model, DraftContext(self.model, 0))
            assert self.d.draft(DraftContext(self.model, 8)) == fresh.draft(
                DraftContext(self.model, 8)
            )


SuffixMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=12)
TestSuffixState = SuffixMachine.TestCase

V = 12
TARGETS = {a: tiny_model(a, vocab=V, seed=3) for a in ("llama", "qwen3")}


@settings(max_examples=20)
@given(
    arch=st.sampled_from(sorted(TARGETS)),
    prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=12),
    max_tokens=st.integers(1, 24),
    seen=st.booleans(),
    gated=st.booleans(),
    pld_first=st.booleans(),
    nodes=st.sampled_from([0, 6]),
)
def test_greedy_output_equals_ar_and_the_view_follows_the_commits(
    arch, prompt, max_tokens, seen, gated, pld_first, nodes
):
    target = TARGETS[arch]
    want = ar_greedy(target, prompt, max_tokens)
    # an index holding the answer itself (every draft right) or random text (mostly wrong)
    rng = np.random.default_rng(len(prompt))
    data = [want] if seen else [rng.integers(0, V, 40).tolist()]
    sfx = drafter(data, min_prob=0.0)
    arms = [PromptLookup(3, 2, 6), sfx] if pld_first else [sfx]
    policy = GatedPolicy(PolicyConfig()) if gated else AlwaysSpeculate()
    cfg = DecodeConfig(max_tokens=max_tokens, tree_nodes=nodes)
    dec = Decoder(KVTarget(target), arms, cfg, policy)
    out = [e.token for e in decode(dec, prompt)]
    assert out == want
    assert sfx.tokens == dec.committed == prompt + out
    if seen and not gated and max_tokens > 2:
        assert dec.stats.accepted > 0


def test_online_growth_keeps_within_the_bound_and_learns_what_joined():
    lib = Library(None, 16, max_online=400)
    rng = np.random.default_rng(0)
    for _ in range(60):
        lib.join(rng.integers(0, 50, 37).tolist())
        assert lib.online_tokens <= 400
        assert len(lib.online) <= 8
    last = rng.integers(100, 150, 30).tolist()
    lib.join(last)
    d = SuffixDrafter(lib, learn=False, min_prob=0.0, context=False)
    d.prefill(last[:10], DraftContext(last[:10], 0))
    assert d.draft(DraftContext(last[:10], 5)).tokens == tuple(last[10:15])
    assert lib.online_tokens <= 400 and lib.nbytes > 0


def test_a_drafter_joins_its_output_at_the_next_prefill_and_when_dropped():
    lib = Library(None, 16, max_online=10_000)
    d = SuffixDrafter(lib, context=False, min_prob=0.0)
    d.prefill([1, 2], DraftContext([], 0))
    d.advance([7, 8, 9, 10, 11], DraftContext([], 0))
    assert lib.online_tokens == 0
    d.prefill([3], DraftContext([], 0))  # a new generation: the last one's output joins
    assert lib.online_tokens == 6  # 5 tokens + the separator
    d.advance([4, 5, 6], DraftContext([], 0))
    del d
    assert lib.online_tokens == 6 + 4
    e = SuffixDrafter(lib, context=False, min_prob=0.0)
    e.prefill([0, 7, 8], DraftContext([], 0))
    assert e.draft(DraftContext([], 3)).tokens == (9, 10, 11)


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_a_finished_generation_joins_and_the_next_one_drafts_it(arch):
    target = TARGETS[arch]
    prompt = [1, 5, 2, 7]
    lib = Library(None, 16, 10_000)
    sfx = SuffixDrafter(lib, context=False, min_prob=0.0)
    first = Decoder(KVTarget(target), [sfx], DecodeConfig(max_tokens=20), AlwaysSpeculate())
    out = [e.token for e in decode(first, prompt)]
    assert lib.online_tokens == len(out) + 1 and first.stats.accepted == 0
    again = SuffixDrafter(lib, context=False, min_prob=0.0)
    second = Decoder(KVTarget(target), [again], DecodeConfig(max_tokens=20), AlwaysSpeculate())
    assert [e.token for e in decode(second, prompt)] == out
    assert second.stats.accepted >= len(out) - second.stats.steps  # its own answer, drafted


def test_persistence_round_trip(tmp_path):
    path = tmp_path / "online.npz"
    lib = Library(None, 16, 10_000, persist=path)
    lib.join([5, 6, 7, 8])
    lib.join([70_000, 1, 2])  # an id past uint16 is kept exactly
    again = Library(None, 16, 10_000, persist=path)
    got = again.online[0].tokens.tolist()
    assert got == [5, 6, 7, 8, SEP, 70_000, 1, 2, SEP]
    assert again.online[0].match([9, 5, 6]).length == 2
    smaller = Library(None, 16, 5, persist=path)  # a smaller bound keeps the newest that fit
    assert smaller.online[0].tokens.tolist() == [70_000, 1, 2, SEP]


def test_data_files_round_trip_and_refuse_another_target(tmp_path):
    target = {"model_type": "llama", "vocab_size": 12, "hidden_size": 64, "num_layers": 2}
    path = save_data(tmp_path / "d.npz", [[1, 2, 3], [4]], target)
    assert load_data(path, target).tolist() == [1, 2, 3, SEP, 4, SEP]
    other = dict(target, vocab_size=13)
    with pytest.raises(DrafterError, match="was made for .*accepted: a file built from"):
        load_data(path, other)
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(DrafterError, match="cannot read suffix data .*adaspec build-suffix"):
        load_data(tmp_path / "bad.npz")


def test_the_registry_builds_it_and_refuses_bad_arguments(tmp_path, monkeypatch):
    monkeypatch.setattr(suffix_store, "_LIBRARIES", {})
    info = target_info(TARGETS["llama"])
    s = settings_mod.from_env({"ADASPEC_CACHE": str(tmp_path / "cache")})
    d = make("suffix:none,min_prob=0.3,depth=8", info, s)
    assert isinstance(d, SuffixDrafter) and d.min_prob == 0.3 and d.depth == 8
    data = save_data(tmp_path / "d.npz", [[1, 2, 3, 4]], suffix_store.target_key(info))
    d = make(f"suffix:{data}", info, s)
    d.prefill([0, 1, 2], DraftContext([], 0))
    assert d.draft(DraftContext([], 4)).tokens[:2] == (3, 4)
    assert list((tmp_path / "cache" / "suffix").glob("*.npy"))  # the array is cached
    for spec, match in [
        ("suffix:none,min_prob=2", "min_prob=2.0 is invalid; accepted: 0..1"),
        ("suffix:none,depth=0", "depth=0, min_match=1 are invalid"),
        ("suffix:none,draft_len=0", "draft_len=0, cap=256 are invalid"),
        ("suffix:none,max_online=-1", "max_online=-1 is invalid"),
        ("suffix:none,colour=1", "suffix argument colour='1' is invalid; accepted: depth="),
        (f"suffix:{tmp_path / 'missing.npz'}", "is not a file; accepted: a file from"),
    ]:
        with pytest.raises(DrafterError, match=match):
            make(spec, info, s)
    with pytest.raises(DrafterError, match="rollback\\(5\\) out of range; accepted: 0..3"):
        d.rollback(5)
    with pytest.raises(DrafterError, match="token id -1 is invalid"):
        d.advance([-1], DraftContext([], 0))


def test_a_shipped_file_is_found_by_the_target_shape():
    info = TargetInfo(None, None, 49152, 576, 30, "llama")  # smollm2-135m
    path = suffix_store.shipped_data(info)
    assert path is not None and len(load_data(path, suffix_store.target_key(info))) > 1_000_000
    assert suffix_store.shipped_data(TargetInfo(None, None, 12, 64, 2, "llama")) is None


def test_build_suffix_writes_a_data_file_from_a_response_store(tmp_path, capsys):
    from adaspec.cli import main
    from adaspec.train.store import Answer, ResponseStore

    target = {"model_type": "llama", "vocab_size": 12, "hidden_size": 64, "num_layers": 2}
    store = ResponseStore(tmp_path / "store", {**target, "tokenizer": "t", "weights": "w"})
    answers = [
        Answer("k1", "a-1", False, np.array([1, 2], np.int32), np.array([3, 4, 5], np.int32)),
        Answer("k2", "a-2", True, np.array([6], np.int32), np.array([7, 8], np.int32)),
    ]
    store.append(answers, max_new=8)
    out = tmp_path / "d.npz"
    assert main(["build-suffix", "--store", str(tmp_path / "store"), "--out", str(out)]) == 0
    assert load_data(out, target).tolist() == [3, 4, 5, SEP, 7, 8, SEP]
    assert "5 tokens from 2 sequences" in capsys.readouterr().out
    assert main(["build-suffix", "--store", str(tmp_path), "--out", str(out)]) == 2
    assert "has no index.json; accepted: a response store folder" in capsys.readouterr().err
