"""The MLX engines' prompt path: a prompt's layers on the matrix units (`prompt_forward` for the
all-resident engine; its pieces for the streaming engine's chunks, compute.py).

`forward` (model.py) runs a prompt through the decode kernels, which are GEMVs: each position
reads every dense weight and each of its k experts again (the seed shape's 2048-token prompt:
2.0 s on the H200 against ~14 ms of matrix-unit compute). Here, per layer, over all T positions
at once (`PROMPT_CHUNK` at a time):

- attention layers: `prompt_attention` (MLX matmuls, `mx.fast.scaled_dot_product_attention`);
  other mixers (DeltaNet, latent attention, gpt-oss's sink and window layers) run their own
  multi-position forms (`model.mixer_partials`: MLX ops for T > 1, as before);
- the router in float32 (design §3: selection is decided in float32), routing on the device;
- routed experts as grouped GEMMs (grouped.py) where a layer has enough (token, expert) pairs
  per expert (`grouped.grouped_pays`; else the decode kernels' fused expert step), the shared
  expert and dense FFN layers as MLX matmuls, the residual in float32;
- the head on the last position only (every position's for a decode window).

The matmuls run on float16 matrix units on a GPU (`prompt_dtype`; the activations as two float16
terms, lowp.py), attention on float16 q/k/v: what the named budget tests/budgets.py PROMPT
covers; the float32 weights of MLX's CPU build leave only the reordering of sums.
`prompt_refusal` names what the path does not serve (the engine then keeps `forward`).

Shapes: T positions, D hidden, V vocab.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.attention import AttentionWeights
from strata.mlx_backend.experts import SharedWeights, combine, experts_route, routed_partials, silu
from strata.mlx_backend.grouped import grouped_experts, grouped_pays, grouped_refusal, route_prompt
from strata.mlx_backend import kernel_plan
from strata.mlx_backend.kernels.launch import current_path
from strata.mlx_backend.model import MlxModelState, MlxParams, embed, head, holds_q8_dense, mixer_partials
from strata.mlx_backend.residual import RESIDUALS
from strata.mlx_backend.lowp import lowp_matmul
from strata.mlx_backend.mixers import mixer_for
from strata.mlx_backend.prompt_attention import attention_refusal, prompt_attention
from strata.mlx_backend.prompt_rows import residual_norm
from strata.reference.experts import expert_act

__all__ = ["PROMPT_MIN_TOKENS", "PROMPT_CHUNK", "prompt_dtype", "prompt_refusal", "uses_prompt_path",
           "prompt_forward", "prompt_mixer", "slot_experts", "swiglu"]

# Below this many positions a prompt keeps the decode kernels (a GEMM's tile is mostly padding).
# The experts have their own crossing (grouped.MIN_PAIRS, by form). A guess until the H200
# measures the crossing (benchmarks/prompt.py --mlx, 128 tokens).
PROMPT_MIN_TOKENS = 32
# Positions per pass: bounds the attention scores ([H, T, S] float32 where MLX has no fused
# kernel) and the sorted expert rows ([T k, D]).
PROMPT_CHUNK = 4096


def prompt_dtype(p: MlxParams) -> mx.Dtype:
    """What the matmuls' inputs are rounded to: the dense weights' dtype (float16 on a GPU)."""
    return p.dtype


def prompt_refusal(p: MlxParams, rec=None) -> str | None:
    """Why the prompt path cannot run this model (None: it can). rec: the streaming arena's record
    layout (default: the resident arena's, `p.rec`)."""
    cfg = p.cfg
    if (why := RESIDUALS[cfg.residual].ops_only) is not None:
        return why
    if cfg.n_moe_layers and (why := grouped_refusal(rec or p.rec, expert_act(cfg))) is not None:
        return why
    if any(lw.router_logit_bias is not None for lw in p.layers):
        return "a router logit bias"
    if holds_q8_dense(p):  # its float16 matmuls take float16 weights; Q8_0 ones go through the Q8_0 GEMV
        return "Q8_0 dense matrices"
    return None


_ASK = object()  # uses_prompt_path: no refusal kept by the caller, ask prompt_refusal


def uses_prompt_path(p: MlxParams, n_tokens: int, rec=None, *, refusal=_ASK) -> bool:
    """Whether an MLX engine takes the prompt path for n_tokens positions: on the GPU kernel path
    (the kernel plan's prompt_paths), from PROMPT_MIN_TOKENS, for a model it serves (refusal: `prompt_refusal`'s
    answer where the caller keeps it)."""
    if n_tokens < PROMPT_MIN_TOKENS:  # first: a decoded token's host turn pays one comparison
        return False
    return current_path() in kernel_plan.current().prompt_paths and (prompt_refusal(p, rec) if refusal is _ASK else refusal) is None


def prompt_forward(p: MlxParams, state: MlxModelState, tokens, *, all_logits: bool = False
                   ) -> tuple[mx.array, MlxModelState]:
    """`model.forward` for a prompt: the same layers on the matrix units.

    Shapes:
        tokens [T] -> logits float32 [1, V] (the last position), or [T, V] with all_logits
    """
    if (why := prompt_refusal(p) or (None if p.arena is not None or not p.cfg.n_moe_layers
                                         else "no resident arena")) is not None:
        raise ValueError(f"prompt path: {why}")
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    rows = []
    for start in range(0, len(tokens), PROMPT_CHUNK):
        x = embed(p, tokens[start:start + PROMPT_CHUNK])
        layers = []
        for layer in range(p.cfg.n_layers):
            x, s = _layer(p, layer, state.layers[layer], x, window=all_logits)
            layers.append(s)
            mx.async_eval(x)  # the GPU runs layer l while the host builds l + 1; bounds live temporaries
        state = MlxModelState(tuple(layers))
        if all_logits:
            rows.append(head(p, x))
        elif start + PROMPT_CHUNK >= len(tokens):
            rows.append(head(p, x[-1:]))
    return (rows[0] if len(rows) == 1 else mx.concatenate(rows)), state


def prompt_mixer(p: MlxParams, layer: int, state, x: mx.array, *, window: bool = False):
    """The layer's mixer over T positions: attention on the matrix units where the prompt path
    serves it, else the mixer's own multi-position form (model.mixer_partials).
    x float32 [T, D] -> (parts float32 [T, P, D], the layer's new state)"""
    w = p.layers[layer].attn
    if mixer_for(p.cfg.kinds[layer].mixer).softmax_attention and isinstance(w, AttentionWeights) \
            and attention_refusal(w) is None:
        a, state = prompt_attention(p.cfg, w, state, x, dtype=prompt_dtype(p))
        return a[:, None, :], state
    return mixer_partials(p, layer, state, x, window=window)  # MLX ops for T > 1 (DeltaNet, MLA, sinks)


def _layer(p: MlxParams, layer: int, state, x: mx.array, *, window: bool):
    """One layer over T positions. x float32 [T, D] -> (float32 [T, D], the layer's new state)"""
    cfg, lw, dtype = p.cfg, p.layers[layer], prompt_dtype(p)
    parts, state = prompt_mixer(p, layer, state, x, window=window)
    x, h = residual_norm(x, parts, lw.ffn_norm, cfg.rms_norm_eps)  # x + parts.sum(axis=1), its norm
    if lw.dense is not None:  # a dense FFN layer
        return x + swiglu(h, lw.dense, dtype), state
    z = h @ lw.router.T  # float32 [T, E]: selection is decided in float32
    base = cfg.moe_index(layer) * cfg.n_experts
    if not grouped_pays(x.shape[0] * cfg.n_experts_per_token, cfg.n_experts):  # the decode kernels' expert step
        routed, shared = experts_route(p.arena.array, p.rec, h, z, base, lw.rule, lw.shared, expert_act(cfg))
        return combine(x, routed, shared, h, lw.shared.gate_inp if lw.shared is not None else None), state
    experts, weights = route_prompt(z, lw.rule)
    records = p.arena.array[base:base + cfg.n_experts]  # [E, SLOT]: slot base + e is expert e
    out = grouped_experts(records, p.rec, h, experts, weights, dtype=dtype, act=expert_act(cfg))
    if lw.shared is not None:
        s = swiglu(h, lw.shared, dtype)
        if lw.shared.gate_inp is not None:
            s = s * mx.sigmoid(h @ lw.shared.gate_inp.astype(mx.float32))[:, None]
        out = out + s
    return x + out, state


def swiglu(h: mx.array, sw: SharedWeights, dtype: mx.Dtype) -> mx.array:
    """The shared expert (or a dense FFN) without its gate. h float32 [T, D] -> float32 [T, D]"""
    hid = silu(lowp_matmul(h, sw.gate, dtype)) * lowp_matmul(h, sw.up, dtype)
    return lowp_matmul(hid, sw.down, dtype)


def slot_experts(arena: mx.array, rec, h: mx.array, slots: np.ndarray, weights: np.ndarray, *, dtype: mx.Dtype,
                 act) -> mx.array:
    """The routed experts of T positions from streaming arena slots (host slots: one pass of the
    cache), as grouped GEMMs over the distinct slots the pass uses.

    Shapes:
        arena uint8 [S, SLOT]; h float32 [T, D]; slots int [T, k] (-1: not in this pass); weights [T, k]
        -> partials float32 [T, P, D]
    """
    s = np.asarray(slots)
    valid = s >= 0
    if not valid.any():
        return mx.zeros((h.shape[0], 1, h.shape[1]), mx.float32)
    used, inv = np.unique(s[valid], return_inverse=True)
    if not grouped_pays(int(valid.sum()), used.size):  # few pairs an expert: the fused kernel reads less
        return routed_partials(arena, rec, h, s.astype(np.int32), np.asarray(weights, np.float32), act=act)
    idx = np.zeros(s.shape, np.int32)
    idx[valid] = inv  # a skipped entry: the first used slot at weight 0
    w = np.where(valid, np.asarray(weights, np.float32), 0.0).astype(np.float32)
    return grouped_experts(arena, rec, h, mx.array(idx), mx.array(w), dtype=dtype, act=act,
                           slots=mx.array(used.astype(np.int32)))[:, None, :]  # expert u of the pass: slot used[u]
