"""Tiny random-weight recurrent and hybrid mlx-lm models (qwen3_next, qwen3_5, mamba2)."""

from __future__ import annotations

# isort: off
import adaspec  # noqa: F401  (must come first: loads the fast BLAS before mlx)
import mlx.core as mx
from tiny import VOCAB, _scale

# isort: on

HYBRIDS = ("qwen3_next", "qwen3_5", "mamba2")

_LINEAR = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)


def _qwen3_next(common: dict, layers: int):
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs(
        model_type="qwen3_next",
        num_hidden_layers=layers,
        head_dim=16,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        full_attention_interval=2,
        # a sparse MoE MLP on every layer, as in the real model (4 experts, top 2)
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        moe_intermediate_size=32,
        mlp_only_layers=[],
        **_LINEAR,
        **common,
    )
    return qwen3_next.Model(args)


def _qwen3_5(common: dict, layers: int):
    from mlx_lm.models import qwen3_5

    text = dict(
        model_type="qwen3_5_text",
        num_hidden_layers=layers,
        head_dim=16,
        max_position_embeddings=4096,
        full_attention_interval=2,
        rope_parameters={
            "type": "default",
            "mrope_section": [1, 1, 0],
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        **_LINEAR,
        **common,
    )
    return qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))


def _mamba2(common: dict, layers: int):
    from mlx_lm.models import mamba2

    args = mamba2.ModelArgs(
        model_type="mamba2",
        num_heads=8,
        head_dim=16,
        vocab_size=common["vocab_size"],
        hidden_size=common["hidden_size"],
        intermediate_size=128,
        state_size=16,
        num_hidden_layers=layers,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=2,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        time_step_limit=(0.0, float("inf")),
        time_step_rank="auto",
    )
    return mamba2.Model(args)


def tiny_hybrid(
    arch: str = "qwen3_next", vocab: int = VOCAB, seed: int = 0, layers: int = 4, scale: float = 2.0
):
    """A random-weight model of `arch` (layers alternate linear attention and full attention
    for the Qwen hybrids; every layer is a Mamba2 block for mamba2)."""
    mx.random.seed(seed)
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=True,
    )
    build = {"qwen3_next": _qwen3_next, "qwen3_5": _qwen3_5, "mamba2": _mamba2}[arch]
    model = build(common, layers)
    _scale(model, scale)
    mx.eval(model.parameters())
    return model
