"""The CPU fast paths, installed on a model by one explicit call and taken off by another.

`install(model)` (made by `adaspec.load`, and so by every CLI command that loads a model)
puts the model on adaspec's kernels, each with stock mlx's bits (docs/fast_ops.md):

- in `model` only: its nn.RoPE, nn.RMSNorm and nn.Linear instances replaced by the twins of
  layers.py; its llama / qwen2 / qwen3 MLP, Attention and TransformerBlock instances given the
  twin classes of native_layers.py (native nodes; mlx-lm's own code where they do not apply);
- in this process, for every model of the same architectures: the mlx-lm model modules'
  `scaled_dot_product_attention` name routed to attention.py (native attention, else
  mlx-lm's), and the `mx` name inside `mlx_lm.generate` to mlx_lm_generate.py's view (the
  vectorized logsumexp), so mlx-lm's own generation pays what adaspec's loop pays.

`uninstall(model)` restores all of it: the model's own classes and stock modules (holding
the same arrays), and mlx-lm's names. Nothing else in adaspec changes mlx-lm's names or a
caller's model: `make_target` on a model of one's own runs it as it is. `installed()` lists
what is in place (printed by `adaspec doctor`). ADASPEC_FAST_OPS=off, another device or
platform: `install` changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import attention, blas, jit, layers, mlx_lm_generate, native, native_layers


@dataclass(frozen=True)
class Installed:
    attention_modules: list[str]  # mlx-lm model modules whose attention name is adaspec's
    layers: int  # nn.RoPE / nn.RMSNorm / nn.Linear instances replaced by their twins
    generate_logsumexp: bool = False  # mlx_lm.generate's `mx` is the vectorized logsumexp's view
    native: int = 0  # MLP / Attention / TransformerBlock instances given a native twin class


def install(model: Any) -> Installed:
    """Put `model` (an mlx-lm model) and mlx-lm's names on the fast paths where they are
    enabled (attention.enabled: the JIT wrapper is active and the device is the CPU); returns
    what changed. Calling it again changes nothing more."""
    if not attention.enabled():
        return Installed([], 0)
    routed = attention.install(model)
    twins = layers.install(model)
    loop = mlx_lm_generate.install()
    native = native_layers.install(model) if blas.routed() else 0
    return Installed(routed, twins, loop, native)


def uninstall(model: Any = None) -> Installed:
    """Take the fast paths off `model` (when given) and give mlx-lm its own names back;
    returns what was restored."""
    native = native_layers.uninstall(model) if model is not None else 0
    twins = layers.uninstall(model) if model is not None else 0
    return Installed(attention.uninstall(), twins, mlx_lm_generate.uninstall(), native)


def installed(model: Any = None) -> dict[str, Any]:
    """What is in place: the mlx-lm model modules routed to adaspec's attention, whether
    mlx_lm.generate runs the vectorized logsumexp, and (given `model`) how many of its
    modules are layer twins and native twin classes."""
    out: dict[str, Any] = {
        "attention_modules": attention.installed(),
        "generate_logsumexp": mlx_lm_generate.installed(),
    }
    if model is not None:
        mods = [m for _, m in model.named_modules()]
        out["layers"] = sum(layers.stock(m) is not None for m in mods)
        out["native"] = sum("_native" in type(m).__dict__ for m in mods)
    return out


def report() -> dict[str, Any]:
    """For `adaspec doctor`: whether mlx's JIT kernels are built for this CPU and the native
    nodes are built (and why not), and what `installed` lists."""
    st = jit.status()
    if attention.enabled() and blas.routed():
        native.get()
    ns = native.status()
    return {
        "native": "active" if ns and ns.active else (ns.reason if ns else "not used"),
        "jit": "active" if st and st.active else (st.reason if st else "not set up"),
        "kernel_dir": str(st.directory) if st and st.directory else None,
        "attention": attention.enabled(),
        **installed(),
        "allocator": os.environ.get("GLIBC_TUNABLES") or "glibc's defaults",
    }


def report_lines(fo: dict[str, Any]) -> list[str]:
    """`report()` as `adaspec doctor` prints it."""
    if not fo:
        return []
    modules = ", ".join(fo["attention_modules"]) or "no model loaded"
    loop = "vectorized" if fo.get("generate_logsumexp") else "mlx's"
    on = f"attention of {modules}; mlx_lm.generate's logsumexp {loop}"
    return [
        f"fast ops      JIT kernels {fo['jit']}; installed (kernels/fast_ops.install): "
        + (on if fo["attention"] else "off (mlx-lm as it is)"),
        f"native ops    {fo.get('native', '?')} (decoder layers, attention)",
        f"allocator     {fo.get('allocator', '?')} (ADASPEC_MALLOC_TCACHE)",
    ]


def model_lines(fo: dict[str, Any] | None) -> list[str]:
    """`installed(model)` as `adaspec doctor --model` prints it."""
    if not fo:
        return []
    return [f"model twins   {fo['layers']} layer twins, {fo['native']} native twin classes"]
