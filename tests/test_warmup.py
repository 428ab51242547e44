"""The warm-up (adaspec/warmup.py): what it runs, and that after `adaspec.load` a generation
builds no kernel (a fresh kernel cache in a process of its own)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from tiny import byte_tokenizer, tiny_model

from adaspec.targets.base import CacheTarget
from adaspec.warmup import PLAIN_TOKENS, WIDTHS, warm_prompt, warm_up


def test_warm_up_runs_plain_steps_and_every_verify_width(monkeypatch):
    rows: list[int] = []
    run = CacheTarget.run

    def recording(self, tokens, taps):
        rows.append(len(tokens))
        return run(self, tokens, taps)

    monkeypatch.setattr(CacheTarget, "run", recording)
    seconds = warm_up(tiny_model("llama"), byte_tokenizer())
    assert seconds > 0
    assert rows.count(1) >= PLAIN_TOKENS - 1  # plain steps
    assert {w + 1 for w in WIDTHS} <= set(rows)  # verify forwards of 2, 4, 8 and 16 rows


def test_warm_up_verifies_trees_where_the_settings_allow_them(monkeypatch):
    from adaspec.settings import from_env
    from adaspec.targets.kv import KVTarget

    trees: list[int] = []
    forward_tree = KVTarget.forward_tree

    def recording(self, tokens, parents, taps=()):
        trees.append(len(tokens))
        return forward_tree(self, tokens, parents, taps)

    monkeypatch.setattr(KVTarget, "forward_tree", recording)
    warm_up(tiny_model("llama"), byte_tokenizer(), settings=from_env({}))
    assert trees == []  # ADASPEC_TREE_NODES=0: chains only
    settings = from_env({"ADASPEC_TREE_NODES": "auto"})
    warm_up(tiny_model("llama"), byte_tokenizer(), settings=settings)
    assert trees == [w + 1 for w in WIDTHS[1:]]  # [last token, nodes...]


def test_warm_prompt_ids_are_in_the_vocabulary():
    for vocab in (2, 3, 300, 49152, 1 << 20):
        ids = warm_prompt(vocab)
        assert len(ids) == 24 and all(0 < t < vocab for t in ids)


# the kernels mlx builds for its compiled CPU functions (kernels/jit.py points it at
# ADASPEC_CACHE/jit), before and after a generation that follows adaspec.load
SCRIPT = """
import json, sys
import adaspec
import mlx.core as mx
from adaspec.kernels import jit

folder = jit.status().kernel_dir(mx.__version__)
built = lambda: sorted(p.name for p in folder.glob("*.so")) if folder.is_dir() else []
model, tok = adaspec.load(sys.argv[1], warmup=sys.argv[2] == "1")
loaded = built()
adaspec.compare_to_ar(model, tok, "x = 1\\nx = 1\\nx = 1\\nx =", drafter="pld", max_tokens=24,
                      warmup=False)
print(json.dumps({"load": loaded, "generate": built()}))
"""


def _kernels_built(gguf, cache, warmup: bool) -> dict:
    from adaspec.settings import get

    cache.mkdir()
    shared = get().cache / "kernels"  # the native extension, built once: not what is tested
    if shared.is_dir():
        (cache / "kernels").symlink_to(shared)
    env = {**os.environ, "ADASPEC_CACHE": str(cache)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(gguf), "1" if warmup else "0"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_after_load_a_generation_builds_no_kernel(tmp_path):
    from gguf_fixtures import write_tiny_gguf

    from adaspec.kernels import jit

    st = jit.status()
    if st is None or not st.active:
        pytest.skip(f"mlx's JIT is not routed through adaspec's cache here: {st}")
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "Q4_1").path
    warm = _kernels_built(gguf, tmp_path / "warm", warmup=True)
    assert warm["load"], "the cache was not fresh, or the warm-up built nothing"
    assert warm["generate"] == warm["load"]  # nothing built inside the timed generations
    cold = _kernels_built(gguf, tmp_path / "cold", warmup=False)
    # without the warm-up the same generations build those kernels themselves
    assert not cold["load"] and cold["generate"]
    assert set(cold["generate"]) <= set(warm["load"])
