"""llama.cpp as a bench peer (adaspec/bench/llamacpp.py, llama_server.py): replies parsed and
counted as the AR column is, bad flags named, the peer's record fields and columns, and a whole
`adaspec bench --peer llama.cpp` against a fake llama-server binary (tiny models, no llama.cpp
needed)."""

import json
import sys
import textwrap

import mlx_lm
import pytest
from tiny import byte_tokenizer, tiny_model

from adaspec.bench import Prompt, markdown, run_suite
from adaspec.bench import llamacpp as lc
from adaspec.bench import plot as bp
from adaspec.bench.llama_server import (
    HttpServer,
    LlamaServer,
    ServerConfig,
    check_binary,
    parse,
    server_args,
    wheel,
)
from adaspec.bench.report import summarize
from adaspec.cli import main
from adaspec.errors import GenerationArgumentError

TOK = byte_tokenizer()
TARGET = tiny_model("llama")
SUITE = [
    Prompt("p0", "code-gen", False, [{"role": "user", "content": "def add(a, b):"}], 10),
    Prompt("p1", "code-edit", True, [{"role": "user", "content": "x = 1\nx = 1\nx ="}], 10),
]


def test_a_native_reply_is_counted_without_eos():
    reply = {
        "content": "hi there",
        "tokens": [7, 8, 9, 2],
        "stop_type": "eos",
        "timings": {"prompt_n": 5, "predicted_n": 4, "predicted_ms": 40.0},
    }
    c = parse(reply, 0.5)
    assert c.tokens == [7, 8, 9] and c.n == 3 and c.text == "hi there"
    assert c.decode_tok_s == pytest.approx(2 / 0.040) and c.prompt_tokens == 5 and c.e2e_s == 0.5
    limit = parse({**reply, "stop_type": "limit"}, 0.5)
    assert limit.tokens == [7, 8, 9, 2] and limit.decode_tok_s == pytest.approx(3 / 0.040)


def test_an_openai_style_reply_and_a_refusal():
    t = {"prompt_n": 3, "predicted_n": 6, "predicted_ms": 50.0, "draft_n": 4}
    c = parse({"choices": [{"text": "abc", "finish_reason": "length"}], "timings": t}, 1.0)
    assert c.tokens is None and c.text == "abc" and c.n == 6 and c.drafts == {"draft_n": 4}
    chat = {"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}], "timings": t}
    assert parse(chat, 1.0).n == 5
    with pytest.raises(Exception, match="llama.cpp answered"):
        parse({"error": {"message": "context overflow"}}, 1.0)


def test_server_flags():
    args = server_args(ServerConfig("m.gguf", 3, 2048, "ngram-mod"))
    assert args[:6] == ["-m", "m.gguf", "-t", "3", "-tb", "3"]
    assert args[-2:] == ["--spec-type", "ngram-mod"] and "--cache-ram" in args
    assert "--spec-type" not in server_args(ServerConfig("m.gguf", 2))


def test_a_bad_binary_is_named_with_what_is_accepted(tmp_path):
    with pytest.raises(GenerationArgumentError, match=r"--llama-server '.*nope' does not exist; "):
        check_binary(str(tmp_path / "nope"))
    plain = tmp_path / "plain"
    plain.write_text("")
    for bad in (tmp_path, plain):
        with pytest.raises(GenerationArgumentError, match="is not an executable; accepted: the"):
            check_binary(str(bad))


def test_a_missing_wheel_says_how_to_get_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "xllamacpp", None)
    with pytest.raises(GenerationArgumentError, match=r"--llama-server PATH .* xllamacpp"):
        wheel()
    with pytest.raises(GenerationArgumentError, match="not installed"):
        lc.check(lc.PeerOptions())


def test_agreement_is_the_shared_start():
    assert lc.agreement("abcd", "abcd") == 1.0
    assert lc.agreement(" abxx", "abcd ") == 0.5
    assert lc.agreement("ab", "abcd") == 0.5 and lc.agreement("", "") == 1.0


class FakeBackend:
    """An in-process stand-in for a server: answers with `answer(ids, n)` -> tokens, text."""

    def __init__(self, answer, drafts=None) -> None:
        self.answer, self.drafts, self.starts = answer, drafts or {}, 0

    def start(self) -> None:
        self.starts += 1

    def stop(self) -> None:
        pass

    def post(self, path: str, body: dict) -> dict:
        assert path == "/completion" and body["temperature"] == 0.0 and not body["cache_prompt"]
        tokens, text = self.answer(body["prompt"], body["n_predict"])
        t = {"prompt_n": len(body["prompt"]), "predicted_n": len(tokens)}
        return {"content": text, "tokens": tokens, "timings": {**t, "predicted_ms": 10.0}}

    def build(self) -> str:
        return "fake"


def greedy(ids: list[int], n: int) -> list[int]:
    return [r.token for r in mlx_lm.stream_generate(TARGET, TOK, ids, max_tokens=n)]


def test_the_peer_in_a_suite_reports_rates_and_agreement():
    """Plain answers mlx-lm's greedy tokens (the same text as adaspec's), ngram-mod changes its
    last token: fields, summary and columns say so; the ngram server starts before every run."""

    def wrong_end(ids, n):
        tokens = greedy(ids, n)
        tokens[-1] = 81 if tokens[-1] != 81 else 82  # "Q" or "R"
        return tokens, TOK.decode(tokens)

    plain = FakeBackend(lambda ids, n: (greedy(ids, n), TOK.decode(greedy(ids, n))))
    ngram = FakeBackend(wrong_end, {"draft_n": 6})
    servers = {"llama": LlamaServer(plain), "llama_ngram": LlamaServer(ngram, fresh=True)}
    peer = lc.LlamaPeer(servers, TOK, {"name": lc.NAME, "build": "fake"})
    res = run_suite(
        TARGET, TOK, SUITE, drafter="pld", repeats=2, progress=False, use_template=False,
        peers=[peer],
    )  # fmt: skip
    assert plain.starts == 1 and ngram.starts == 1 + 2 * 2  # warm-up, then 2 prompts x 2 runs
    for r in res["records"]:
        assert r["llama_same_text"] and r["llama_first_divergence"] is None
        assert not r["llama_ngram_same_text"] and r["llama_ngram_first_divergence"] == 9
        assert r["llama_tok_s"] == pytest.approx(900.0)  # 9 tokens after the first in 10 ms
        # ratios are rounded to 4 places: a slow run's small ratio is off by up to 5e-5
        assert r["spec_vs_llama"] == pytest.approx(r["spec_tok_s"] / 900.0, abs=6e-5)
        assert r["ar_vs_llama"] == pytest.approx(r["ar_tok_s"] / 900.0, abs=6e-5)
        assert r["llama_prompt_match"] and r["llama_ngram_drafted"] == 0
    b = res["summary"]["all"]
    assert b["llama_same_text"] == 2 and b["llama_ngram_same_text"] == 0
    assert b["median_llama_tok_s"] == 900.0 and res["config"]["llama_cpp"]["build"] == "fake"
    table = markdown(res["records"], res["summary"])
    assert "| llama.cpp tok/s | spec vs llama.cpp | ngram-mod tok/s |" in table
    assert "| 900.0 |" in table and "| 2/2 |" in table
    assert ("llama.cpp ngram-mod", "llama_ngram_tok_s") in bp.rate_series(res["records"])
    json.dumps(res)


def test_columns_come_from_the_records_present():
    rec = {"category": "qa", "grounded": True, "speedup": 1.5, "e2e_speedup": 1.5, "tau": 2.0}
    rec |= {"floored_fraction": 0.0, "identical": True, "ar_tok_s": 10.0, "spec_tok_s": 15.0}
    assert "llama.cpp" not in markdown([rec], summarize([rec]))
    assert bp.rate_series([rec]) == [("adaspec", "spec_tok_s"), ("mlx-lm AR", "ar_tok_s")]
    stock = {**rec, "stock_tok_s": 5.0, "spec_vs_stock": 3.0, "ar_vs_stock": 2.0}
    stock["stock_identical"] = True
    table = markdown([stock], summarize([stock]))
    assert "| stock mlx-lm tok/s |" in table and "| 3.00x | 1/1 |" in table
    assert "llama.cpp" not in table


FAKE_SERVER = """\
    #!{python}
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    args = sys.argv[1:]
    if "--version" in args:
        print("version: 7 (fake llama-server)", file=sys.stderr)
        sys.exit(0)
    with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
        f.write(" ".join(args) + " env=" + os.environ.get("FAKE_ENV", "") + "\\n")
    spec = "--spec-type" in args


    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.reply({{"status": "ok"}})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = req["n_predict"]
            t = {{"prompt_n": len(req["prompt"]), "predicted_n": n, "predicted_ms": 5.0 * n}}
            if spec:
                t.update(draft_n=8, draft_n_accepted=6)
            out = {{"content": "zz" * n, "tokens": [3] * n, "stop_type": "limit"}}
            self.reply({{**out, "timings": t}})


    HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    path = tmp_path / "llama-server"
    path.write_text(textwrap.dedent(FAKE_SERVER).format(python=sys.executable))
    path.chmod(0o755)
    log = tmp_path / "starts.log"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    return path, log


def test_a_binary_is_started_asked_and_stopped(fake_server):
    path, log = fake_server
    cfg = ServerConfig("m.gguf", 2, spec="ngram-mod", env=("FAKE_ENV=a=b",))
    server = HttpServer(str(path), cfg)
    assert server.build() == "version: 7 (fake llama-server)"
    llama = LlamaServer(server, fresh=True)
    c = llama.complete([1, 2, 3], 4)
    assert c.tokens == [3, 3, 3, 3] and c.prompt_tokens == 3 and c.drafts["draft_n"] == 8
    llama.complete([1, 2], 4)
    proc = server.proc
    llama.close()
    assert proc is not None and proc.poll() is not None and server.proc is None
    starts = log.read_text().splitlines()
    assert len(starts) == 2 and all("--spec-type ngram-mod" in s for s in starts)
    assert all(s.endswith(" env=a=b") for s in starts)  # --llama-env reaches the binary


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from adaspec import settings

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path / "cache"))
    settings.get.cache_clear()
    yield
    settings.get.cache_clear()


def test_cli_bench_with_llama_cpp_from_a_binary(fake_server, tmp_path, cache, capsys):
    from gguf_fixtures import write_tiny_gguf

    path, log = fake_server
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "Q8_0").path
    suite, out = tmp_path / "suite.jsonl", tmp_path / "bench.json"
    suite.write_text(
        "".join(json.dumps({"id": p.id, "messages": p.messages}) + "\n" for p in SUITE)
    )
    argv = ["bench", "--model", str(gguf), "--suite", str(suite), "--drafter", "pld"]
    argv += ["--max-tokens", "6", "--repeats", "1", "--json", str(out)]
    argv += ["--peer", "llama.cpp", "--llama-server", str(path), "--llama-threads", "1"]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    for r in res["records"]:
        assert r["llama_tok_s"] == pytest.approx(5 / 0.030, abs=0.01) and r["llama_prompt_match"]
        assert not r["llama_same_text"] and r["llama_ngram_drafted"] == 8
    cfg = res["config"]["llama_cpp"]
    assert cfg["gguf"] == str(gguf) and cfg["threads"] == 1 and cfg["server"] == str(path)
    text = capsys.readouterr().out
    assert "| llama.cpp tok/s |" in text and "llama.cpp: version: 7 (fake llama-server)" in text
    m = res["config"]["machine"]  # as adaspec doctor measures it, and the load around the run
    assert m["peak_gflops"] > 0 and m["read_gbs"] > 0 and m["cores"] >= 1 and "load_end" in m
    assert f"{m['peak_gflops']:.0f} fp32 GFLOP/s peak, {m['read_gbs']:.0f} GB/s read" in text
    assert len(log.read_text().splitlines()) == 1 + 1 + 2  # plain once; ngram: warm + 2 runs


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--llama-server", "/nowhere/llama-server"], "--llama-server '/nowhere/llama-server' "),
        (["--llama-threads", "-1"], "--llama-threads=-1 is invalid"),
        (["--llama-env", "1X=2"], "--llama-env '1X=2' is invalid; accepted: NAME=VALUE"),
        (["--llama-env", "A=1"], "accepted with --llama-server PATH"),
    ],
)
def test_bad_llama_flags_fail_before_the_model_loads(extra, message, capsys):
    assert main(["bench", "--model", "nowhere", "--peer", "llama.cpp", *extra]) == 2
    assert message in capsys.readouterr().err


def test_llama_flags_need_the_llama_peer(capsys):
    assert main(["bench", "--model", "nowhere", "--llama-server", "/x"]) == 2
    assert "accepted with --peer llama.cpp" in capsys.readouterr().err


def test_a_model_without_a_gguf_is_refused(tmp_path):
    with pytest.raises(GenerationArgumentError, match="is not one; accepted: a catalogue name"):
        lc.gguf_of(str(tmp_path))
