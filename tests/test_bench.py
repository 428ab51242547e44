"""The bench with mlx-lm's speculative decoding as a peer column: the step accounting rebuilt
from mlx-lm's from_draft flags (pure), and a whole suite on a tiny random pair (tier 2)."""

import argparse
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiny import byte_tokenizer, save_tiny, tiny_model

from adaspec.bench import Prompt, markdown, run_suite
from adaspec.bench.mlx_spec import PeerConfig, SpecPeer, draft_of, spec_counts
from adaspec.cli import bench as cli_bench
from adaspec.cli import main
from adaspec.errors import GenerationArgumentError


@st.composite
def spec_runs(draw):
    """A generation as mlx-lm's speculative loop emits it: per step, min(k, left) drafted, a
    accepted, then one target token unless max_tokens was reached."""
    k, max_tokens = draw(st.integers(1, 6)), draw(st.integers(1, 40))
    flags, steps, drafted, accepted = [], 0, 0, 0
    while len(flags) < max_tokens:
        nd = min(k, max_tokens - len(flags))
        a = draw(st.integers(0, nd))
        flags += [True] * a
        steps, drafted, accepted = steps + 1, drafted + nd, accepted + a
        if len(flags) < max_tokens:
            flags.append(False)
    return flags, k, max_tokens, (steps, drafted, accepted)


@given(spec_runs())
def test_spec_counts_rebuild_the_steps(run):
    flags, k, max_tokens, (steps, drafted, accepted) = run
    c = spec_counts(flags, k, max_tokens)
    assert (c["steps"], c["drafted"], c["accepted"]) == (steps, drafted, accepted)
    assert c["tau"] == round(len(flags) / steps, 4)


def test_spec_counts_examples():
    # k=3: step 1 accepts 3 + bonus, step 2 accepts 1 + correction, step 3 cut at max_tokens
    c = spec_counts([True] * 3 + [False] + [True, False] + [True, True], 3, 8)
    assert (c["steps"], c["drafted"], c["accepted"]) == (3, 8, 6)
    assert c["acceptance_first"] == 1.0 and c["tau"] == round(8 / 3, 4)
    assert spec_counts([], 4, 10)["tau"] == 0.0


TOK = byte_tokenizer()
TARGET = tiny_model("llama")
DRAFT = tiny_model("qwen3", seed=5, layers=1)
SUITE = [
    Prompt("p0", "code-gen", False, [{"role": "user", "content": "def add(a, b):"}], 12),
    Prompt("p1", "code-edit", True, [{"role": "user", "content": "x = 1\nx = 1\nx ="}], 12),
]


@pytest.mark.parametrize("peer_k", [3, 0])
def test_suite_with_mlx_lm_spec_peer(peer_k, tmp_path):
    peer = PeerConfig(DRAFT, k=peer_k, tune_prompts=1, tune_tokens=8)
    folder = save_tiny(DRAFT, TOK, tmp_path / "draft")
    res = run_suite(
        TARGET,
        TOK,
        SUITE,
        drafter=f"draft-model:{folder}",
        repeats=1,
        progress=False,
        use_template=False,
        peers=[SpecPeer(peer, TARGET, TOK, {})],
    )
    for r in res["records"]:
        assert r["identical"] and r["peer_identical"]  # T=0: all three emit AR's tokens
        assert r["peer_k"] in (2, 3, 4, 5, 6) and r["peer_tok_s"] > 0
        assert 0 <= r["peer_acceptance_rate"] <= 1 and r["peer_tau"] >= 1
        assert r["spec_vs_peer"] == pytest.approx(r["spec_tok_s"] / r["peer_tok_s"], rel=0.01)
    assert res["config"]["peer"]["tuned"] == (peer_k == 0)
    if peer_k == 0:
        assert sorted(res["config"]["peer"]["tune_decode_tok_s"]) == [2, 3, 4, 5, 6]
    assert res["summary"]["all"]["peer_identical"] == 2
    assert "spec vs peer" in markdown(res["records"], res["summary"])
    json.dumps(res)


def test_sampled_suite_keeps_peer_accounting():
    res = run_suite(
        TARGET,
        TOK,
        SUITE[:1],
        drafter="pld",
        repeats=1,
        progress=False,
        use_template=False,
        spec_kwargs={"temp": 0.7, "seed": 3},
        peers=[SpecPeer(PeerConfig(DRAFT, k=2), TARGET, TOK, {"temp": 0.7, "seed": 3})],
    )
    r = res["records"][0]
    assert r["peer_k"] == 2 and r["tokens"] == 12 and 0 <= r["peer_acceptance_first"] <= 1


def _args(**kw) -> argparse.Namespace:
    base = dict(
        peer="mlx-lm-spec",
        peer_draft=None,
        drafter="pld",
        peer_k=0,
        peer_tune_prompts=2,
        peer_tune_tokens=48,
        llama_server=None,
        llama_threads=0,
        llama_env=[],
    )
    return argparse.Namespace(**{**base, **kw})


def test_cli_peer_arguments_are_checked():
    from adaspec.drafters.arms import plan
    from adaspec.settings import from_env
    from adaspec.targets.base import target_info

    info = target_info(DRAFT)
    spec = lambda s: plan(s, info, from_env({}))  # noqa: E731
    options = lambda **kw: cli_bench.peer_options(_args(**kw))  # noqa: E731
    assert cli_bench.check_peers(_args(peer=None)) == []
    assert cli_bench.check_peers(_args(peer="mlx-lm-spec,mlx-lm-spec")) == ["mlx-lm-spec"]
    with pytest.raises(GenerationArgumentError, match="--peer 'vllm' is unknown; accepted"):
        cli_bench.check_peers(_args(peer="vllm", peer_draft="x"))
    with pytest.raises(GenerationArgumentError, match="needs a draft model"):
        draft_of(options(), spec("pld"))
    assert draft_of(options(), spec("auto:draft-model:somewhere,min_p1=0.5")) == "somewhere"
    assert draft_of(options(peer_draft="mine"), spec("draft-model:somewhere")) == "mine"
    with pytest.raises(GenerationArgumentError, match="--peer-k=99"):
        cli_bench.check_peers(_args(peer_k=99))


def test_cli_bench_with_a_peer_draft_and_the_default_drafter(tmp_path):
    target = save_tiny(tiny_model("qwen3", seed=1), TOK, tmp_path / "target")
    draft = save_tiny(DRAFT, TOK, tmp_path / "draft")
    suite, out = tmp_path / "suite.jsonl", tmp_path / "bench.json"
    suite.write_text(
        "".join(json.dumps({"id": p.id, "messages": p.messages}) + "\n" for p in SUITE)
    )
    argv = ["bench", "--model", str(target), "--suite", str(suite), "--limit", "1"]
    argv += ["--max-tokens", "8", "--repeats", "1", "--ignore-chat-template", "--json", str(out)]
    assert main([*argv, "--peer", "mlx-lm-spec", "--peer-draft", str(draft), "--peer-k", "2"]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["drafter"] == "auto"  # prompt and suffix lookup where no DFlash ships
    (r,) = res["records"]
    assert r["identical"] and r["peer_identical"] and r["peer_k"] == 2 and r["tokens"] == 8


def test_cli_bench_selects_prompts_by_category_and_names_unknown_ones():
    suite = [
        Prompt("a", "qa", True, [{"role": "user", "content": "x"}], 8),
        Prompt("b", "story", False, [{"role": "user", "content": "y"}], 8),
        Prompt("c", "math", False, [{"role": "user", "content": "z"}], 8),
    ]
    ids = lambda ps: [p.id for p in ps]  # noqa: E731
    assert ids(cli_bench.select(suite, ["qa,math"], None, None)) == ["a", "c"]
    assert ids(cli_bench.select(suite, ["qa", "story"], "no", None)) == ["b"]
    assert ids(cli_bench.select(suite, [], None, 2)) == ["a", "b"]
    with pytest.raises(GenerationArgumentError, match="--category poem is not in the suite; "):
        cli_bench.select(suite, ["qa,poem"], None, None)
    with pytest.raises(GenerationArgumentError, match="no prompts left"):
        cli_bench.select(suite, ["qa"], "no", None)
