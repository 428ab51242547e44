"""A target sharded over two local processes (ring backend on 127.0.0.1): every drafter's greedy
output equals mlx-lm's AR on the same sharding (and, for pipeline sharding, which changes no
sum, one process's); a rank that dies or hangs ends the other with a clear error, not a hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
TINY_PROMPTS = [[72, 101, 108, 108, 111, 32] * 3, list(b"abcabcabcabd"), list(b"the cat, the")]
SMOL_PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps.",
    "Add a docstring: def add(a, b): return a + b",
    "Tell a short story about a robot.",
]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start(cfg: dict, tmp: Path, env: dict | None = None, size: int = 2) -> list:
    """Start `size` ranks of the worker as mlx.launch would on one host (ring backend)."""
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(size)]))
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    base = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(WORKER.parent)]),
        "MLX_HOSTFILE": str(hostfile),
        **(env or {}),
    }
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp / "cfg.json")],
            env={**base, "MLX_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(size)
    ]


def finish(procs: list, timeout: float) -> list[tuple[int | None, str]]:
    """(exit code, stderr) of each rank; a rank still running after `timeout` is killed and
    reported with code None."""
    deadline = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out.append((p.returncode, err))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            out.append((None, err))
    return out


def run(cfg: dict, tmp: Path, size: int = 2, timeout: float = 900, env=None) -> dict:
    cfg = {**cfg, "out": str(tmp / "out.json")}
    results = finish(start(cfg, tmp, env, size=size), timeout)
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{err[-3000:]}"
    return json.loads((tmp / "out.json").read_text())


def one_process(cfg: dict, tmp: Path, env=None) -> dict:
    tmp.mkdir()
    cfg = {**cfg, "out": str(tmp / "out.json")}
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(WORKER.parent)]),
        **(env or {}),
    }
    env.pop("MLX_HOSTFILE", None)
    env.pop("MLX_RANK", None)
    subprocess.run([sys.executable, str(WORKER), str(tmp / "cfg.json")], env=env, check=True)
    return json.loads((tmp / "out.json").read_text())


def assert_identical(got: dict, ref_ar: list) -> None:
    assert got["ar"] == ref_ar
    for d, outs in got["spec"].items():
        for i, (spec, ar) in enumerate(zip(outs, ref_ar)):
            assert spec == ar, f"{d} differs from AR on prompt {i}"


TINY = {"model": "tiny", "drafters": ["none", "pld", "draft-model:tiny"], "max_tokens": 40}


def test_tiny_pipeline_matches_ar_and_one_process(tmp_path):
    cfg = {**TINY, "shard": "pipeline", "prompts": TINY_PROMPTS}
    (tmp_path / "two").mkdir()
    got = run(cfg, tmp_path / "two")
    assert got["sharding"].startswith("pipeline over 2 ranks (ring): layers 1-1 of 2")
    single = one_process(cfg, tmp_path / "one")
    assert_identical(got, got["ar"])
    assert got["ar"] == single["ar"]  # pipeline sharding changes no sum
    assert got["wire_bytes"][0] > 0 and got["collectives"] > 0


def test_tiny_qwen3_pipeline_matches_ar_and_one_process(tmp_path):
    cfg = {**TINY, "model": "tiny:qwen3", "shard": "pipeline", "prompts": TINY_PROMPTS}
    cfg["drafters"] = ["pld"]
    (tmp_path / "two").mkdir()
    got = run(cfg, tmp_path / "two")
    assert_identical(got, got["ar"])
    assert got["ar"] == one_process(cfg, tmp_path / "one")["ar"]


def test_tiny_tensor_matches_ar_on_the_same_sharding(tmp_path):
    cfg = {**TINY, "shard": "tensor", "prompts": TINY_PROMPTS}
    got = run(cfg, tmp_path)
    assert got["sharding"].startswith("tensor over 2 ranks (ring)")
    assert_identical(got, got["ar"])


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_that_dies_or_hangs_ends_the_other(tmp_path, how):
    cfg = {**TINY, "shard": "pipeline", "prompts": TINY_PROMPTS, "rounds": 10**6}
    cfg.update(drafters=["pld"], out=str(tmp_path / "out.json"), pids=str(tmp_path))
    procs = start(cfg, tmp_path, env={"ADASPEC_DIST_TIMEOUT": "3"})
    pid = tmp_path / "rank1.pid"
    deadline = time.monotonic() + 120
    while not pid.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # well into generating
    victim = procs[1]
    try:
        victim.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        (code, err), *_ = finish(procs[:1], timeout=60)
        took = time.monotonic() - t0
    finally:
        victim.kill()
        victim.communicate()
    assert code is not None, "rank 0 hung after its peer was lost"
    assert code != 0
    if how == "kill":  # mlx raises, or the watchdog sees the closed connection
        assert "lost its peers" in err or "a peer closed its connection" in err, err[-2000:]
    else:
        assert "no answer from the other ranks for 3 s" in err, err[-2000:]
    assert took < 30


SMOL = {
    "model": "smollm2-135m",
    "drafters": ["pld", "dflash", "auto", "none"],
    "prompts": SMOL_PROMPTS,
    "max_tokens": 48,
}


@pytest.mark.slow
def test_smollm2_pipeline_every_drafter_matches_ar_and_one_process(tmp_path):
    cfg = {**SMOL, "shard": "pipeline"}
    (tmp_path / "two").mkdir()
    got = run(cfg, tmp_path / "two")
    assert got["sharding"] == "pipeline over 2 ranks (ring): layers 15-29 of 30 on rank 0"
    assert_identical(got, got["ar"])
    single = one_process({**cfg, "drafters": []}, tmp_path / "one")
    assert got["ar"] == single["ar"]


@pytest.mark.slow
def test_smollm2_pipeline_dflash_drafts_from_the_same_features(tmp_path):
    """DFlash reads tap layers both ranks run: with every draft of a fixed length and no
    gate, it drafts what it drafts in one process, token for token (so tau is equal)."""
    cfg = {**SMOL, "shard": "pipeline", "drafters": ["dflash"], "max_tokens": 32}
    fixed = {"ADASPEC_GATE": "off", "ADASPEC_DRAFT_ADAPTIVE": "false", "ADASPEC_DRAFT_MAX": "3"}
    (tmp_path / "two").mkdir()
    got = run(cfg, tmp_path / "two", env=fixed)
    single = one_process(cfg, tmp_path / "one", env=fixed)
    assert got["spec"] == single["spec"]
    assert got["tau"]["dflash"] == single["tau"]["dflash"]
    assert max(got["tau"]["dflash"]) > 1.2  # drafts are accepted: the features are right


# --- pure parts: the split, the layer map, doctor's lines ---


@pytest.mark.parametrize("layers,size", [(30, 2), (2, 2), (7, 3), (24, 4), (5, 5)])
def test_pipeline_split_is_mlx_lms(layers, size):
    from mlx_lm.models.pipeline import PipelineMixin

    from adaspec.distributed.shard import Sharding, pipeline_split

    class Group:
        def __init__(self, r):
            self.r = r

        def rank(self):
            return self.r

        def size(self):
            return size

    starts, counts = pipeline_split(layers, size)
    for r in range(size):
        m = PipelineMixin()
        m.layers = list(range(layers))
        m.pipeline(Group(r))
        assert (m.start_idx, m.end_idx) == (starts[r], starts[r] + counts[r])
        s = Sharding("pipeline", r, size, "ring", m.start_idx, m.end_idx, layers)
        for layer in range(layers):
            owner = s.owner(layer)
            assert starts[owner] <= layer < starts[owner] + counts[owner]
            assert (s.local(layer) is not None) == (owner == r)


def test_doctor_says_how_the_target_is_sharded():
    from adaspec.doctor import _distributed_lines

    net = {"ranks": 2, "backend": "ring", "round_trip_us_384B": 95.0, "round_trip_us_36KB": 130.0}
    d = {"distributed": net, "settings": {"ADASPEC_SHARD": "auto"}, "model": {"num_layers": 30}}
    lines = _distributed_lines(d)
    assert lines[0] == (
        "ranks         2 (ring), target sharded: pipeline "
        "(rank 0: layers 15-29, rank 1: layers 0-14)"
    )
    assert "95 us (384 B)" in lines[1]
    one = _distributed_lines({"distributed": {"ranks": 1, "backend": "none"}, "settings": {}})
    assert one[0].startswith("ranks         1 (not started by mlx.launch")


def test_shard_refuses_what_it_cannot_split():
    from tiny import tiny_model

    from adaspec.distributed.shard import shard
    from adaspec.distributed.world import World
    from adaspec.errors import DistributedError

    w = World(None, 0, 3, "ring")
    with pytest.raises(DistributedError, match="num_attention_heads=4, which does not split"):
        shard(tiny_model("llama"), w, "tensor")
    with pytest.raises(DistributedError, match="fewer than the 3 ranks"):
        shard(tiny_model("llama", layers=2), w, "pipeline")
    with pytest.raises(DistributedError, match="accepted: auto, pipeline, tensor"):
        shard(tiny_model("llama"), w, "rows")


@pytest.mark.slow
def test_a_pipeline_rank_releases_the_stored_matrices_of_layers_it_does_not_run():
    from adaspec.cli.common import load_model
    from adaspec.distributed.shard import pipeline
    from adaspec.distributed.world import World

    model, _ = load_model("smollm2-135m")
    registry = model.adaspec_stored
    before, count = registry.nbytes, len(registry.matrices)
    pipeline(model, World(None, 1, 2, "ring"))  # rank 1: layers 0-14 (no collective here)
    per_layer = 7  # q, k, v, o, gate, up, down
    assert len(registry.matrices) == count - 15 * per_layer
    layers = before - model.model.embed_tokens._stored.nbytes  # every rank keeps the table
    assert 0.45 < (before - registry.nbytes) / layers < 0.55
