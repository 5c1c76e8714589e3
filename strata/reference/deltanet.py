"""The gated DeltaNet mixer (Qwen3-Next, Qwen3.5 / 3.6-MoE), pure numpy: state in, state out.

Per layer, for the normed input x [T, D] (C = 2 K + V channels, K = Hk dk, V = Hv dv, r = Hv / Hk):

    qkv = x Wqkv^T            [T, C]   q (Hk heads), k (Hk heads), v (Hv heads)
    qkv = silu(causal depthwise conv_K(qkv))      the conv state holds the last K-1 inputs
    q = l2norm(q) / sqrt(dk), k = l2norm(k)       each q/k head serves r consecutive v heads
    beta = sigmoid(x Wbeta^T), g = a * softplus(x Walpha^T + dt_bias)     [T, Hv], a = -exp(A_log) < 0
    per position, per v head (S: [dk, dv], the recurrent state):
        S <- exp(g) S;  S <- S + k ((v - S^T k) beta)^T;  o = S^T q      (the gated delta rule)
    out = (rms_norm(o) * w_norm * gate(z)) Wout^T,  z = x Wz^T           (the gated RMSNorm, per head)

gate is silu, or sigmoid where the config says so (`cfg.qwen4.deltanet_sigmoid_gate`: the
released Qwen3.8-Flash-Next's `output_gate_type: "sigmoid"`).

The recurrence is computed position by position (the definition; the MLX twin adds the chunked
form). A recurrent layer keeps only its latest state, so `DeltaNetState` also keeps snapshots
(`kept`): one at the end of every call and, for a decode window (`window=True`), one after every
position, the most recent KEPT_SNAPSHOTS of them. `trim(n)` restores the snapshot at n;
`kept_position(n)` is the largest restorable position <= n (0 always is: the empty state).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.formats.dense_weights import as_dense_weights
from strata.model_config import ModelConfig, TensorNames
from strata.reference.attention import rms_norm, sigmoid

# transformers' l2norm (and the flash-linear-attention kernels') add this inside the rsqrt
L2NORM_EPS = 1e-6
# torch's softplus returns x itself above this (beta = 1), where log1p(exp(x)) == x in float32 anyway
SOFTPLUS_THRESHOLD = 20.0
# How many snapshots a layer keeps (the most recent). One costs Hv dk dv + C (K-1) float32 per
# DeltaNet layer: 195 MB for all 45 layers of Qwen3.5-397B (64 x 128 x 128), 66 MB for the 30 of
# Qwen3.6-35B (32 x 128 x 128); 16 of them are 3.1 GB and 1.05 GB (docs/models.md).
KEPT_SNAPSHOTS = 16


@dataclass(frozen=True)
class Snapshot:
    """A DeltaNet layer's state after `position` positions."""

    position: int
    conv: np.ndarray  # [C, K-1]
    recurrent: np.ndarray  # [Hv, dk, dv]


@dataclass(frozen=True)
class DeltaNetState:
    """One DeltaNet layer's state after `length` positions, and the snapshots it can go back to.

    Shapes: conv [C, K-1] (the last K-1 conv inputs, oldest first), recurrent [Hv, dk, dv]"""

    conv: np.ndarray
    recurrent: np.ndarray
    length: int = 0
    kept: tuple[Snapshot, ...] = ()  # by position, ascending

    @staticmethod
    def empty(cfg: ModelConfig) -> "DeltaNetState":
        c = conv_channels(cfg)
        dn = cfg.deltanet
        conv = np.zeros((c, dn.linear_conv_kernel - 1), np.float32)
        rec = np.zeros((dn.linear_v_heads, dn.linear_k_head_dim, dn.linear_v_head_dim), np.float32)
        return DeltaNetState(conv, rec)

    @property
    def kept_positions(self) -> tuple[int, ...]:
        """Every position `trim` can restore, ascending."""
        return tuple(sorted({0, self.length, *(s.position for s in self.kept)}))

    def kept_position(self, n: int) -> int:
        """The largest restorable position <= n."""
        return max(p for p in self.kept_positions if p <= n)

    def trim(self, n: int) -> "DeltaNetState":
        """The state after the first n positions: the current one, a kept snapshot, or empty (n = 0)."""
        if n == self.length:
            return self
        kept = tuple(s for s in self.kept if s.position <= n)
        if n == 0:  # `* 0`: zeros of the same kind (numpy here, MLX in its twin, which holds this state)
            return DeltaNetState(self.conv * 0, self.recurrent * 0)
        if not kept or kept[-1].position != n:
            raise ValueError(f"trim: a DeltaNet layer keeps no snapshot at position {n} "
                             f"(kept: {self.kept_positions}; trim to kept_position(n))")
        return DeltaNetState(kept[-1].conv, kept[-1].recurrent, n, kept)

    def keep(self, snapshots: list[Snapshot]) -> "DeltaNetState":
        """The same state with `snapshots` added (the oldest dropped past KEPT_SNAPSHOTS)."""
        kept = tuple(s for s in self.kept if s.position < snapshots[0].position) + tuple(snapshots)
        return DeltaNetState(self.conv, self.recurrent, self.length, kept[-KEPT_SNAPSHOTS:])


def kept_position(layers, n: int) -> int:
    """The largest m <= n (n already within [0, length]) every layer can restore: every m for
    attention layers, a position kept by every DeltaNet layer."""
    kept = [set(s.kept_positions) for s in layers if isinstance(s, DeltaNetState)]
    return max(p for p in set.intersection(*kept) if p <= n) if kept else n  # 0 is in every set


def conv_channels(cfg: ModelConfig) -> int:
    """C: the q, k and v channels the conv runs over."""
    dn = cfg.deltanet
    return 2 * dn.linear_k_heads * dn.linear_k_head_dim + dn.linear_v_heads * dn.linear_v_head_dim


def silu(x: np.ndarray) -> np.ndarray:
    return (x * sigmoid(x)).astype(np.float32)


def softplus(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return np.where(x > SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(np.minimum(x, SOFTPLUS_THRESHOLD)))).astype(np.float32)


def l2norm(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis."""
    return (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(L2NORM_EPS))).astype(np.float32)


def causal_conv(state: np.ndarray, weight: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv of x after the previous K-1 inputs, then SiLU.

    Shapes:
        state [C, K-1], weight [C, K], x [T, C] -> (out [T, C], padded inputs [K-1+T, C])
    """
    k = weight.shape[1]
    padded = np.concatenate([state.T, x], axis=0)  # [K-1+T, C]
    t = x.shape[0]
    out = np.zeros_like(x)
    for j in range(k):  # out[t] = sum_j w[:, j] * padded[t + j]
        out += weight[:, j] * padded[j:j + t]
    return silu(out), padded


def gated_delta_step(s: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                     beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One position of the gated delta rule for every v head.

    Shapes:
        s [Hv, dk, dv], q/k [Hv, dk] (normed, q scaled), v [Hv, dv], g/beta [Hv] -> (o [Hv, dv], s)
    """
    s = s * np.exp(g)[:, None, None]
    kv_mem = np.einsum("hkv,hk->hv", s, k)  # what the state already predicts for k
    delta = (v - kv_mem) * beta[:, None]
    s = (s + k[:, :, None] * delta[:, None, :]).astype(np.float32)
    return np.einsum("hkv,hk->hv", s, q).astype(np.float32), s


def deltanet_inputs(cfg: ModelConfig, dense, layer: int, x: np.ndarray):
    """The projections before the conv: (qkv [T, C], z [T, V], beta [T, Hv], g [T, Hv])."""
    n = TensorNames
    dense = as_dense_weights(dense)  # a plain dict of float32 arrays (tests) is wrapped
    w = lambda s: dense[n.block(layer, s)]  # noqa: E731
    proj = lambda s, a: dense.linear(n.block(layer, s), a)  # noqa: E731  a W^T
    qkv = proj(n.ssm_qkv, x).astype(np.float32)
    z = proj(n.ssm_z, x).astype(np.float32)
    beta = sigmoid(proj(n.ssm_beta, x).astype(np.float32))
    g = (w(n.ssm_a) * softplus(proj(n.ssm_alpha, x) + w(n.ssm_dt_bias))).astype(np.float32)
    return qkv, z, beta, g


def split_heads(cfg: ModelConfig, mixed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The conv output as per-v-head q, k (normed, q scaled, k heads repeated r times) and v.

    Shapes: mixed [T, C] -> q [T, Hv, dk], k [T, Hv, dk], v [T, Hv, dv]"""
    t, hk, dk = mixed.shape[0], cfg.deltanet.linear_k_heads, cfg.deltanet.linear_k_head_dim
    r = cfg.deltanet.linear_v_heads // hk
    q = mixed[:, :hk * dk].reshape(t, hk, dk)
    k = mixed[:, hk * dk:2 * hk * dk].reshape(t, hk, dk)
    v = mixed[:, 2 * hk * dk:].reshape(t, cfg.deltanet.linear_v_heads, cfg.deltanet.linear_v_head_dim)
    q = l2norm(q) * np.float32(dk ** -0.5)
    k = l2norm(k)
    return np.repeat(q, r, axis=1), np.repeat(k, r, axis=1), v  # v head h reads k head h // r


def output_gate(cfg: ModelConfig, z: np.ndarray) -> np.ndarray:
    """The gated RMSNorm's gate: sigmoid(z) where cfg.qwen4.deltanet_sigmoid_gate, else silu(z)."""
    return sigmoid(z).astype(np.float32) if cfg.qwen4.deltanet_sigmoid_gate else silu(z)


def gated_output(cfg: ModelConfig, dense, layer: int, o: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The gated RMSNorm per head and the output projection. o [T, Hv, dv], z [T, V] -> [T, D]"""
    n = TensorNames
    dense = as_dense_weights(dense)
    t = o.shape[0]
    normed = rms_norm(o, dense[n.block(layer, n.ssm_norm)], cfg.rms_norm_eps) * output_gate(cfg, z.reshape(o.shape))
    return dense.linear(n.block(layer, n.ssm_out), normed.reshape(t, -1)).astype(np.float32)


def deltanet(cfg: ModelConfig, dense, layer: int, state: DeltaNetState, x: np.ndarray, *,
             window: bool = False) -> tuple[np.ndarray, DeltaNetState]:
    """The gated DeltaNet mixer over T new positions (see the module doc).

    window: a decode window, so a snapshot is kept after every position (else only at the end).

    Shapes:
        x: [T, D] (already normed) -> ([T, D], DeltaNetState with T more positions)
    """
    qkv, z, beta, g = deltanet_inputs(cfg, dense, layer, x)
    mixed, padded = causal_conv(state.conv, dense[TensorNames.block(layer, TensorNames.ssm_conv)], qkv)
    q, k, v = split_heads(cfg, mixed)
    keep = cfg.deltanet.linear_conv_kernel - 1
    s, outs, snaps = state.recurrent, [], []
    t_len = x.shape[0]
    for t in range(t_len):
        o, s = gated_delta_step(s, q[t], k[t], v[t], g[t], beta[t])
        outs.append(o)
        if window or t == t_len - 1:  # the conv state after t + 1 positions: padded[t+1 : t+K]
            conv = np.ascontiguousarray(padded[t + 1:t + 1 + keep].T)
            snaps.append(Snapshot(state.length + t + 1, conv, s))
    last = snaps[-1]
    new = DeltaNetState(last.conv, last.recurrent, state.length + t_len, state.kept).keep(snaps)
    return gated_output(cfg, dense, layer, np.stack(outs), z), new
