"""Gated-delta replay: advance a Gated-DeltaNet state over recorded inputs, returning only the
final state (rollback needs no outputs). Plain mlx ops everywhere; a Metal kernel on Apple GPUs.

The recurrence per step t and head: S_t = g_t S_{t-1} + u_t k_t^T with
u_t = beta_t (v_t - g_t S_{t-1} k_t); S is (Dv, Dk), g_t and beta_t are scalars per head.
"""

from __future__ import annotations

import mlx.core as mx


@mx.compile
def _step(k: mx.array, v: mx.array, g: mx.array, beta: mx.array, s: mx.array) -> mx.array:
    # s: (B, H, Dv, Dk); k: (B, H, Dk); v: (B, H, Dv); g, beta: (B, H)
    s = s * g[..., None, None]
    kv = (s * k[..., None, :]).sum(axis=-1)
    u = (v - kv) * beta[..., None]
    return s + k[..., None, :] * u[..., None]


def replay_ops(k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array) -> mx.array:
    """The state after the T steps, with plain ops (any device), one fused step at a time.

    k: (B, T, Hk, Dk); v: (B, T, Hv, Dv); g, beta: (B, T, Hv); state: (B, Hv, Dv, Dk).
    (The queries are not needed: the state does not depend on them.)
    A closed form (one triangular solve and a few batched matmuls for all T) was measured too:
    ~3x faster with OpenBLAS at T=5, but ~7x slower with MKL, whose per-call cost on many tiny
    matmuls dominates on a busy 2-core machine; the step loop needs no BLAS.
    """
    _check(k, v, g, beta, state)
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        k = mx.repeat(k, rep, axis=2)
    for t in range(k.shape[1]):
        state = _step(k[:, t], v[:, t], g[:, t], beta[:, t], state)
    return state


def _check(k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array) -> None:
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    if g.shape != (B, T, Hv) or beta.shape != (B, T, Hv) or state.shape != (B, Hv, Dv, Dk):
        raise ValueError(
            f"gated-delta shapes k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, "
            f"state {state.shape}; accepted: k (B,T,Hk,Dk), v (B,T,Hv,Dv), g and beta (B,T,Hv) "
            "(scalar gates), state (B,Hv,Dv,Dk), Hv a multiple of Hk"
        )
    if Hv % Hk:
        raise ValueError(f"{Hv} value heads are not a multiple of {Hk} key heads")


# One SIMD group (32 lanes) owns one value row of one head; each lane keeps Dk/32 entries of
# that row of S in registers for all T steps, so the state is read and written once.
_SOURCE = """
    const uint n = thread_position_in_grid.z;           // batch * Hv + head
    const uint b = n / Hv;
    const uint h = n % Hv;
    const uint hk = h / (Hv / Hk);
    const uint row = thread_position_in_grid.y;          // value index in [0, Dv)
    const uint lane = thread_position_in_threadgroup.x;  // 0..31
    constexpr int per_lane = Dk / 32;

    const device float* s_in = state_in + (n * Dv + row) * Dk + lane * per_lane;
    device float* s_out = state_out + (n * Dv + row) * Dk + lane * per_lane;
    float s[per_lane];
    for (int i = 0; i < per_lane; ++i) {
        s[i] = s_in[i];
    }
    for (int t = 0; t < steps; ++t) {
        const device InT* k_t = k + ((b * steps + t) * Hk + hk) * Dk + lane * per_lane;
        const uint gate_at = (b * steps + t) * Hv + h;
        const float gate = static_cast<float>(g[gate_at]);
        float dot = 0.0f;
        for (int i = 0; i < per_lane; ++i) {
            s[i] *= gate;
            dot += s[i] * static_cast<float>(k_t[i]);
        }
        dot = simd_sum(dot);
        const float vt = static_cast<float>(v[((b * steps + t) * Hv + h) * Dv + row]);
        const float upd = (vt - dot) * static_cast<float>(beta[gate_at]);
        for (int i = 0; i < per_lane; ++i) {
            s[i] += static_cast<float>(k_t[i]) * upd;
        }
    }
    for (int i = 0; i < per_lane; ++i) {
        s_out[i] = s[i];
    }
"""

_kernel = None


def _metal_kernel():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.metal_kernel(
            name="adaspec_gated_delta_replay",
            input_names=["k", "v", "g", "beta", "state_in", "steps"],
            output_names=["state_out"],
            source=_SOURCE,
        )
    return _kernel


def kernel_usable(k: mx.array) -> bool:
    """The Metal kernel runs on an available Metal GPU for key dims that are multiples of 32."""
    return (
        mx.metal.is_available()
        and mx.default_device() == mx.gpu
        and k.shape[-1] >= 32
        and k.shape[-1] % 32 == 0
    )


def replay_kernel(
    k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> mx.array:
    """`replay_ops` as one Metal kernel launch (Metal only; see `kernel_usable`)."""
    _check(k, v, g, beta, state)
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    (out,) = _metal_kernel()(
        inputs=[k, v, g, beta, state.astype(mx.float32), T],
        template=[("InT", k.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[state.shape],
        output_dtypes=[mx.float32],
    )
    return out


def gated_delta_replay(
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    *,
    use_kernel: bool = True,
) -> mx.array:
    """The Gated-DeltaNet state after the T recorded steps: the Metal kernel when `use_kernel`
    and it is usable here, the plain ops otherwise (always on CPU)."""
    if use_kernel and kernel_usable(k):
        return replay_kernel(k, v, g, beta, state)
    return replay_ops(k, v, g, beta, state)
