"""llama.cpp's server for the bench: a `llama-server` binary over HTTP on a free local port, or
the same server code in this process from the `xllamacpp` wheel (`pip install
"adaspec[llamacpp]"`), with the same flags and requests.

Flags, as llama-server spells them: `-m GGUF -t T -tb T -ngl 0 -np 1 -c 4096 --jinja
--cache-ram 0 --temp 0 --top-k 1`, plus `--spec-type ngram-mod` (or another of llama.cpp's
n-gram types) for its speculation. A request is greedy (temperature 0, top_k 1) without the
prompt cache: `/completion` with the prompt as token ids (what adaspec's tokenizer made of the
chat-templated messages, used as given) and `return_tokens`, or `/v1/chat/completions` with
the messages (llama.cpp applies the chat template stored in the GGUF).

Decode tok/s is counted as bench/timing.py counts it: the tokens after the first over the
time after it, EOS not counted. llama.cpp reports predicted_n tokens (EOS included) over
predicted_ms, which starts when the first token is sampled.

A native build for this CPU, from the sources vendored in PyPI's llama-cpp-python sdist (~10
min on 2 cores):

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/ && cmake -S vendor/llama.cpp -B build -G Ninja -DGGML_NATIVE=ON \\
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \\
        && ninja -C build llama-server      # then: --llama-server $PWD/build/bin/llama-server

The x86_64 wheel is a fixed AVX2 build (no AVX-512 even on a CPU that has it).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import AdaspecError, GenerationArgumentError

CTX = 4096
START_TIMEOUT_S = 60.0
WHEEL_HINT = 'the xllamacpp wheel (pip install "adaspec[llamacpp]")'


class LlamaServerError(AdaspecError):
    """llama.cpp failed: the server did not start, or a request was refused."""


@dataclass(frozen=True)
class ServerConfig:
    """One server's settings; spec: llama.cpp's --spec-type (e.g. "ngram-mod"), None: plain;
    env: NAME=VALUE items added to a binary's environment (e.g. OMP_WAIT_POLICY=PASSIVE)."""

    gguf: str
    threads: int
    ctx: int = CTX
    spec: str | None = None
    verbose: bool = False
    env: tuple[str, ...] = ()


def server_args(cfg: ServerConfig) -> list[str]:
    """llama-server's flags for `cfg`."""
    t = str(cfg.threads)
    args = ["-m", cfg.gguf, "-t", t, "-tb", t, "-ngl", "0", "-np", "1", "-c", str(cfg.ctx)]
    args += ["--jinja", "--cache-ram", "0", "--temp", "0", "--top-k", "1"]
    return args + (["--spec-type", cfg.spec] if cfg.spec else [])


@dataclass(frozen=True)
class Completion:
    """One generation: its text, its token ids (None where the server does not return them),
    tokens output (EOS not counted), decode rate, request seconds, prompt tokens the server
    evaluated, and llama.cpp's drafted / accepted counts."""

    text: str
    tokens: list[int] | None
    n: int
    decode_tok_s: float
    e2e_s: float
    prompt_tokens: int
    drafts: dict = field(default_factory=dict)


def parse(reply: dict, e2e_s: float) -> Completion:
    """A reply of llama-server's, native (/completion) or OpenAI-style (the wheel, chat)."""
    if "timings" not in reply:
        raise LlamaServerError(f"llama.cpp answered {str(reply)[:500]}")
    t = reply["timings"]
    choice = (reply.get("choices") or [{}])[0]
    text = reply.get("content", choice.get("text", choice.get("message", {}).get("content", "")))
    eos = reply.get("stop_type") == "eos" or choice.get("finish_reason") == "stop"
    n = int(t["predicted_n"]) - eos  # EOS is not output
    rate = (n - 1) / t["predicted_ms"] * 1e3 if n > 1 and t["predicted_ms"] > 0 else 0.0
    tokens = reply.get("tokens")
    if tokens is not None:
        tokens = [int(x) for x in tokens][:n]
    drafts = {k: int(t[k]) for k in ("draft_n", "draft_n_accepted") if k in t}
    return Completion(text or "", tokens, n, rate, e2e_s, int(t["prompt_n"]), drafts)


class Backend(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...

    def post(self, path: str, body: dict) -> dict: ...

    def build(self) -> str: ...


def check_env(items: tuple[str, ...], binary: str | None) -> None:
    """--llama-env items: NAME=VALUE each, for a binary (the wheel shares this process's)."""
    for item in items:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", item):
            raise GenerationArgumentError(
                f"--llama-env {item!r} is invalid; accepted: NAME=VALUE, e.g. "
                "OMP_WAIT_POLICY=PASSIVE"
            )
    if items and not binary:
        raise GenerationArgumentError(
            "--llama-env sets a llama-server binary's environment; accepted with "
            "--llama-server PATH"
        )


def check_binary(path: str) -> str:
    """`path` as a runnable llama-server binary, or an error naming it and what is accepted."""
    accepted = "accepted: the path of a llama-server binary (docs/benchmarks.md: how to build one)"
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise GenerationArgumentError(f"--llama-server {path!r} does not exist; {accepted}")
    if not os.path.isfile(full) or not os.access(full, os.X_OK):
        raise GenerationArgumentError(f"--llama-server {path!r} is not an executable; {accepted}")
    return full


class HttpServer:
    """A llama-server binary on a free local port, its log in a temporary file."""

    def __init__(self, binary: str, cfg: ServerConfig) -> None:
        self.cmd, self.env = [binary, *server_args(cfg)], cfg.env
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile("w+")
        self.url = ""
        atexit.register(self.stop)  # no server outlives the process

    def _tail(self) -> str:
        self.log.seek(0)
        return " | ".join(self.log.read().strip().splitlines()[-6:])

    def start(self) -> None:
        self.stop()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [*self.cmd, "--host", "127.0.0.1", "--port", str(port)]
        self.log.seek(0)
        self.log.truncate()
        env = dict(os.environ, **dict(item.split("=", 1) for item in self.env))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaServerError(f"{' '.join(cmd)} exited: {self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise LlamaServerError(f"{' '.join(cmd)} did not answer /health in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as f:
                return dict(json.load(f))
        except urllib.error.HTTPError as e:
            raise LlamaServerError(f"llama-server {path}: {e.code} {e.read()[:500]!r}") from None
        except OSError as e:
            raise LlamaServerError(f"llama-server {path}: {e}; its log: {self._tail()}") from None

    def build(self) -> str:
        """The binary's version and build (`--version`)."""
        out = subprocess.run([self.cmd[0], "--version"], capture_output=True, text=True)
        return " ".join((out.stdout + out.stderr).split())


def wheel() -> Any:
    """The xllamacpp module, or an error saying how to get llama.cpp."""
    try:
        import xllamacpp
    except ImportError:
        raise GenerationArgumentError(
            "--peer llama.cpp needs llama.cpp: --llama-server PATH (a llama-server binary) or "
            f"{WHEEL_HINT}; xllamacpp is not installed"
        ) from None
    return xllamacpp


class WheelServer:
    """llama-server's code in this process (xllamacpp.Server), no HTTP."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg, self.server = cfg, None
        self.xl = wheel()

    def _params(self) -> Any:
        xl, cfg = self.xl, self.cfg
        p = xl.CommonParams()
        p.model.path = cfg.gguf
        p.n_gpu_layers = 0
        p.cpuparams.n_threads = p.cpuparams_batch.n_threads = cfg.threads
        p.n_parallel, p.n_ctx, p.cache_ram_mib, p.use_jinja = 1, cfg.ctx, 0, True
        p.sampling.temp, p.sampling.top_k = 0.0, 1
        p.port = 0  # any free port: several servers live in this process
        if not cfg.verbose:
            p.verbosity = -1
        if cfg.spec:
            name = "COMMON_SPECULATIVE_TYPE_" + cfg.spec.upper().replace("-", "_")
            p.speculative.types = [getattr(xl.common_speculative_type, name)]
        return p

    def start(self) -> None:
        self.server = None  # the old one stops before the new one loads
        self.server = self.xl.Server(self._params())

    def stop(self) -> None:
        self.server = None

    def post(self, path: str, body: dict) -> dict:
        if self.server is None:
            raise LlamaServerError("the llama.cpp server is not started")
        handle = {
            "/completion": self.server.handle_completions,
            "/v1/chat/completions": self.server.handle_chat_completions,
        }[path]
        return dict(handle(body))

    def build(self) -> str:
        info = " ".join(self.xl.get_system_info().split())
        return f"xllamacpp {self.xl.__version__}: {info}"


class LlamaServer:
    """One llama.cpp server; `fresh`: started again before every request (llama.cpp's n-gram
    speculation keeps what it learned across requests, adaspec's runs carry nothing over)."""

    def __init__(self, backend: Backend, fresh: bool = False) -> None:
        self.backend, self.fresh, self.started = backend, fresh, False

    def _ask(self, path: str, body: dict) -> Completion:
        if self.fresh or not self.started:
            self.backend.start()
            self.started = True
        req = {"temperature": 0.0, "top_k": 1, "cache_prompt": False, **body}
        t0 = time.perf_counter()
        reply = self.backend.post(path, req)
        return parse(reply, time.perf_counter() - t0)

    def complete(self, ids: list[int], max_tokens: int) -> Completion:
        body = {"prompt": [int(t) for t in ids], "n_predict": max_tokens, "return_tokens": True}
        return self._ask("/completion", body)

    def chat(self, messages: list[dict], max_tokens: int) -> Completion:
        return self._ask("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens})

    def close(self) -> None:
        self.backend.stop()
        self.started = False
