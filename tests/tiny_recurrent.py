"""Tiny random-weight recurrent and hybrid mlx-lm models: qwen3_next, qwen3_5 and mamba2 (every
rollback strategy), and more ArraysCache architectures that only the generic one serves."""

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


def _qwen3_5(common: dict, layers: int, moe: bool = False):
    from mlx_lm.models import qwen3_5, qwen3_5_moe

    experts = dict(
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=64,
        moe_intermediate_size=32,
    )
    text = dict(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
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
        **(experts if moe else {}),
    )
    module = qwen3_5_moe if moe else qwen3_5
    return module.Model(
        module.ModelArgs(model_type=module.__name__.split(".")[-1], text_config=text)
    )


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
    build = {
        "qwen3_next": _qwen3_next,
        "qwen3_5": _qwen3_5,
        "qwen3_5_moe": lambda c, n: _qwen3_5(c, n, moe=True),
        "mamba2": _mamba2,
    }[arch]
    model = build(common, layers)
    _scale(model, scale)
    mx.eval(model.parameters())
    return model


# Other architectures with recurrent state (mlx-lm ModelArgs fields, tiny sizes)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, hidden_size=64)
OTHER_CONFIGS = {
    "lfm2": dict(  # short convolutions (ArraysCache of one array) + attention
        num_hidden_layers=4,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=128,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        **_ATTN,
    ),
    "falcon_h1": dict(  # Mamba2 and attention side by side in one CacheList per layer
        head_dim=16,
        intermediate_size=128,
        mamba_d_conv=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_n_heads=4,
        num_hidden_layers=2,
        rope_theta=10000.0,
        **_ATTN,
    ),
    "jamba": dict(  # Mamba (v1) layers + attention, MoE MLPs
        intermediate_size=128,
        num_hidden_layers=4,
        attn_layer_offset=1,
        attn_layer_period=2,
        expert_layer_offset=1,
        expert_layer_period=2,
        mamba_d_conv=4,
        mamba_d_state=16,
        mamba_expand=2,
        num_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        **_ATTN,
    ),
    "nemotron_h": dict(  # Mamba2 mixers, attention and MLP blocks as separate layers
        intermediate_size=128,
        max_position_embeddings=4096,
        attention_bias=False,
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=1,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        hybrid_override_pattern=list("M*M-"),
        head_dim=16,
        **_ATTN,
    ),
    "recurrent_gemma": dict(  # RG-LRU recurrence + local attention in a rotating window of 8
        attention_bias=False,
        conv1d_width=4,
        intermediate_size=128,
        logits_soft_cap=30.0,
        num_hidden_layers=3,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attention_window_size=8,
        block_types=["recurrent", "recurrent", "attention"],
        **{**_ATTN, "num_key_value_heads": 1},
    ),
}


def tiny_other(arch: str, seed: int = 0, scale: float = 2.0):
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict({"model_type": arch, **OTHER_CONFIGS[arch]}))
    _scale(model, scale)
    mx.eval(model.parameters())
    return model
