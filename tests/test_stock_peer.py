"""Stock mlx-lm as a peer (adaspec/bench/stock.py): the worker never imports adaspec, its runs
are counted as the AR column's are, and the bench and generate report it (tiny models)."""

import json
import os

import pytest
from tiny import byte_tokenizer, save_tiny, tiny_model

from adaspec.bench import Prompt, markdown, run_suite, timed
from adaspec.bench.stock import (
    StockPeer,
    StockPeerError,
    StockSource,
    run_of,
    stock_source,
    worker_env,
)
from adaspec.cli import main

TOK = byte_tokenizer()
TARGET = tiny_model("qwen3", seed=1)  # a folder mlx_lm.load reads back
SUITE = [
    Prompt("p0", "code-gen", False, [{"role": "user", "content": "def add(a, b):"}], 12),
    Prompt("p1", "code-edit", True, [{"role": "user", "content": "x = 1\nx = 1\nx ="}], 12),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(TARGET, TOK, tmp_path_factory.mktemp("stock") / "target")


def test_the_worker_runs_stock_mlx_lm_without_adaspec(folder):
    import mlx_lm

    ids = TOK.encode("x = 1\nx = 1\nx =")
    with StockPeer(StockSource(str(folder), False)) as stock:
        info = stock.describe()
        run = stock.run(ids, 12)
    assert stock.info["adaspec_imported"] is False
    assert not [name for name in info["libraries"] if "adaspec" in name]
    assert info["versions"]["mlx-lm"] == mlx_lm.__version__
    ar = timed(mlx_lm.stream_generate(TARGET, TOK, ids, max_tokens=12))
    assert run.tokens == ar.tokens and run.decode_tok_s > 0 and run.e2e_s > 0


def test_a_worker_error_names_the_cause(tmp_path):
    with pytest.raises(StockPeerError, match="stock mlx-lm: .*"):
        StockPeer(StockSource(str(tmp_path / "missing"), False))


def test_runs_are_counted_as_the_ar_column_is():
    reply = {"tokens": [5, 6, 7, 2], "t0": 0.0, "t_first": 1.0, "t_end": 2.0}
    stop = run_of({**reply, "finish_reason": "stop", "last_text_empty": True})
    assert stop.tokens == [5, 6, 7] and stop.decode_tok_s == pytest.approx(2.0)
    assert stop.e2e_s == pytest.approx(2.0)
    length = run_of({**reply, "finish_reason": "length", "last_text_empty": False})
    assert length.tokens == [5, 6, 7, 2] and length.decode_tok_s == pytest.approx(3.0)


def test_the_workers_environment_is_without_adaspecs_changes(tmp_path):
    from adaspec.kernels import jit

    wrapper = tmp_path / "bin"
    wrapper.mkdir()
    (wrapper / "g++").write_text(jit.wrapper_text("/usr/bin/g++", tmp_path / "tmp"))
    env = {
        "PATH": os.pathsep.join([str(wrapper), "/usr/bin"]),
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=1000",
        "HOME": "/home/x",
    }
    out = worker_env(env, tcache=1000)
    assert out["PATH"] == "/usr/bin" and out["HOME"] == "/home/x"
    assert out["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    alone = worker_env({"PATH": "/usr/bin", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=1000"})
    assert "GLIBC_TUNABLES" not in alone
    mine = worker_env({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}, 1000)
    assert mine["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=7"  # the user's own


def test_a_folder_is_its_own_source_and_a_gguf_its_fp32_expansion(folder, tmp_path):
    from gguf_fixtures import write_tiny_gguf

    from adaspec.settings import from_env

    settings = from_env({}, cache=str(tmp_path / "cache"))
    assert stock_source(str(folder), settings).path == str(folder)
    gguf = write_tiny_gguf(tmp_path / "t.gguf", "llama", "Q8_0").path
    src = stock_source(str(gguf), settings)
    assert src.path.startswith(str(tmp_path / "cache" / "models")) and "float32" in src.path
    assert not src.fp32  # the expansion is fp32 already


def test_suite_with_the_stock_peer(folder):
    with StockPeer(StockSource(str(folder), False)) as stock:
        res = run_suite(
            TARGET, TOK, SUITE, drafter="pld", repeats=1, progress=False, use_template=False,
            peers=[stock],
        )  # fmt: skip
    for r in res["records"]:
        assert r["stock_identical"] and r["stock_tok_s"] > 0
        assert r["spec_vs_stock"] == pytest.approx(r["spec_tok_s"] / r["stock_tok_s"], rel=0.01)
        assert r["ar_vs_stock"] == pytest.approx(r["ar_tok_s"] / r["stock_tok_s"], rel=0.01)
    assert res["summary"]["all"]["stock_identical"] == 2
    assert res["config"]["stock"]["name"] == "mlx-lm-stock"
    assert "spec vs stock" in markdown(res["records"], res["summary"])
    json.dumps(res)


def test_cli_bench_and_generate_with_stock_mlx_lm(folder, tmp_path, capsys):
    suite, out = tmp_path / "suite.jsonl", tmp_path / "bench.json"
    suite.write_text(json.dumps({"id": "p", "messages": SUITE[1].messages}) + "\n")
    argv = ["bench", "--model", str(folder), "--suite", str(suite), "--drafter", "pld"]
    argv += ["--max-tokens", "8", "--repeats", "1", "--ignore-chat-template", "--json", str(out)]
    assert main([*argv, "--peer", "mlx-lm-stock"]) == 0
    (r,) = json.loads(out.read_text())["records"]
    assert r["stock_identical"] and r["tokens"] == 8
    assert "identical to stock" in capsys.readouterr().out
    argv = ["generate", "--model", str(folder), "--prompt", "x = 1\nx = 1\nx =", "--drafter"]
    argv += ["pld", "--max-tokens", "8", "--ignore-chat-template", "--compare-stock"]
    assert main([*argv, "--compare-ar"]) == 0
    err = capsys.readouterr().err
    assert "[compare-ar] AR" in err
    assert "[compare-stock] stock mlx-lm" in err and "identical: True" in err


def test_an_unknown_peer_is_named_before_the_model_loads(capsys):
    assert main(["bench", "--model", "nowhere", "--peer", "mlx-lm-stok"]) == 2
    assert "--peer 'mlx-lm-stok' is unknown; accepted: mlx-lm-spec, mlx-lm-stock" in (
        capsys.readouterr().err
    )
