"""`MlxCompute`: the runtime's LayerCompute seam (strata.runtime.compute) on MLX arrays.

The streaming loop calls mixer -> router_input -> router_logits (host) -> shared (during the
host turn) -> routed -> guess_logits (after the turn) -> combine for each layer. Here:

- mixer returns a lazy `_Residual` (the residual in, the mixer's partials);
- router_input launches the router kernel once: residual after attention, h, the router logits
  and the next MoE layer's Q8_0 guess logits together; router_logits is the layer's one host round
  trip (evaluating z evaluates the guess too, so guess_logits costs a copy, not a sync);
- shared and routed are started with `mx.async_eval`, so the GPU runs them while the host takes
  its turn (design §4: the shared expert between signal and wait) and does its after-layer work;
- combine adds the partials (one list per pass; several passes in a prompt) and the shared expert;
- a dense FFN layer is `dense_ffn` (MLX ops: no router, no experts, no host round trip);
- a prompt chunk of PROMPT_MIN_TOKENS or more positions (on the GPU) takes the prompt path's
  pieces (prompt.py): attention as matmuls and fused attention, the router as MLX ops, each
  pass's experts as grouped GEMMs over the distinct slots it uses, the shared expert as matmuls.

Decode launches per layer: QKV, attend, output projection, router, shared, routed, combine = 7
(the all-resident engine puts the shared expert's blocks in the routed launch: 6; here it runs
alone, during the host turn).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from strata.formats.expert_record import RecordLayout
from strata.mlx_backend.arena import MlxArena, layer_record
from strata.mlx_backend.experts import combine, routed_partials, shared_partials
from strata.mlx_backend.model import (
    MlxModelState, MlxParams, dense_ffn, embed, ffn_input, head, mixer_partials, router_stage,
)
from strata.mlx_backend.kernels.launch import KernelPath, using_path
from strata.mlx_backend.prompt import (
    prompt_dtype, prompt_mixer, prompt_refusal, slot_experts, swiglu, uses_prompt_path,
)
from strata.mlx_backend.quants import gemv
from strata.reference.attention import KVPrecision
from strata.reference.experts import expert_act
from strata.runtime.compute import StatefulCompute

__all__ = ["MlxCompute", "hand_off"]


def hand_off(out: mx.array, slots: np.ndarray) -> mx.array:
    """Start a pass's routed partials `out` on the device; slots [T, k] are the slots it reads."""
    if slots.shape[0] > 1:
        # A prompt layer may run in several passes whose slots the next pass reuses (design §5):
        # the pass must have read its slots before the cache hands them out again.
        mx.eval(out)
    else:
        mx.async_eval(out)  # decode: one pass, its slots pinned for the whole window
    return out


class _Residual:
    """What `attention` hands the loop: the layer's input residual and attention partials; after
    `router_input`, also the residual after attention and the router input."""

    __slots__ = ("layer", "x", "parts", "x_mid", "h")

    def __init__(self, layer: int, x: mx.array, parts: mx.array) -> None:
        self.layer, self.x, self.parts = layer, x, parts
        self.x_mid = self.h = None


class _RouterInput:
    __slots__ = ("layer", "h", "z", "g", "g_layer", "residual")

    def __init__(self, layer: int, h: mx.array, z: mx.array, g: mx.array | None, g_layer: int | None,
                 residual: _Residual) -> None:
        self.layer, self.h, self.z, self.g, self.g_layer, self.residual = layer, h, z, g, g_layer, residual


class MlxCompute(StatefulCompute):
    """LayerCompute over MlxParams (dense, resident) and an MlxArena (experts by slot)."""

    synchronous = False  # `routed` hands the experts to the device (async_eval): hand-off after it

    def __init__(self, params: MlxParams, arena: MlxArena, layout: RecordLayout, *, pred_q8: bool = True,
                 kv_precision: KVPrecision = KVPrecision.F32,
                 layer_layouts: tuple[RecordLayout, ...] | None = None) -> None:
        """layout: the arena's record layout; layer_layouts: each MoE layer's, where they differ
        (arena.record_layouts)."""
        self.params, self.arena, self.layout, self.pred_q8 = params, arena, layout, pred_q8
        self.layer_layouts = layer_layouts
        self.state = MlxModelState.empty(params.cfg, kv_precision)
        moe = params.cfg.moe_layers
        self._next_moe = {l: (moe[i + 1] if i + 1 < len(moe) else None) for i, l in enumerate(moe)}
        self._refusal = prompt_refusal(params, layout)  # asked once: `_prompt` runs 5 times a layer

    def embed(self, tokens: np.ndarray) -> mx.array:
        return embed(self.params, tokens)

    def _prompt(self, x: mx.array) -> bool:
        """Whether these positions take the prompt path's pieces (prompt.py: matmuls, grouped GEMMs)."""
        return uses_prompt_path(self.params, x.shape[0], refusal=self._refusal)

    def mixer(self, layer: int, x: mx.array, *, window: bool = False) -> _Residual:
        layers = list(self.state.layers)
        mix = prompt_mixer if self._prompt(x) else mixer_partials
        parts, layers[layer] = mix(self.params, layer, layers[layer], x, window=window)
        self.state = MlxModelState(tuple(layers))
        return _Residual(layer, x, parts)

    def dense_ffn(self, layer: int, x: _Residual) -> mx.array:
        x_mid, h = ffn_input(self.params, layer, x.x, x.parts)
        if self._prompt(x.x):
            return x_mid + swiglu(h, self.params.layers[layer].dense, prompt_dtype(self.params))
        return dense_ffn(self.params, layer, x_mid, h)

    def router_input(self, layer: int, x: _Residual) -> _RouterInput:
        nxt = self._next_moe[layer]  # the router kernel computes the next MoE layer's guess with z
        guess = self.params.layers[nxt].guess if self.pred_q8 and nxt is not None else None
        if self._prompt(x.x):  # the router kernel is a GEMV per position: MLX ops (matmuls) here
            with using_path(KernelPath.OPS):
                x.x_mid, x.h, z, g = router_stage(self.params, layer, x.x, x.parts, guess)
        else:
            x.x_mid, x.h, z, g = router_stage(self.params, layer, x.x, x.parts, guess)
        return _RouterInput(layer, x.h, z, g, nxt if guess is not None else None, x)

    def router_logits(self, layer: int, h: _RouterInput) -> np.ndarray:
        return np.array(h.z, dtype=np.float32)  # the layer's host round trip

    def guess_logits(self, layer: int, h: _RouterInput) -> np.ndarray:
        lw = self.params.layers[layer]
        if h.g is not None and layer == h.g_layer:
            g = h.g  # computed with z by the router kernel
        else:
            g = gemv(lw.guess, h.h) if self.pred_q8 and lw.guess is not None else h.h @ lw.router.T
        if lw.router_logit_bias is not None:  # gpt-oss: the guessed layer's own logit bias
            g = g + lw.router_logit_bias
        return np.array(g, dtype=np.float32)

    def shared(self, layer: int, h: _RouterInput):
        sw = self.params.layers[layer].shared
        if sw is None:
            return None
        if self._prompt(h.h):
            out = swiglu(h.h, sw, prompt_dtype(self.params))[:, None, :]  # combine applies the gate
        else:
            out = shared_partials(h.h, sw)
        mx.async_eval(out)  # runs on the GPU while the host takes its turn
        return out

    def routed(self, layer: int, h: _RouterInput, slots: np.ndarray, weights: np.ndarray) -> mx.array:
        if self._prompt(h.h):  # the pass's distinct slots as grouped GEMMs
            out = slot_experts(self.arena.array, self.layout, h.h, slots, weights, dtype=prompt_dtype(self.params),
                               act=expert_act(self.params.cfg))
        else:
            rec = layer_record(self.layout, self.layer_layouts, self.params.cfg.moe_index(layer))
            out = routed_partials(self.arena.array, rec, h.h, np.asarray(slots, np.int32),
                                  np.asarray(weights, np.float32), act=expert_act(self.params.cfg))
        return hand_off(out, slots)

    def combine(self, x: _Residual, parts: Sequence[mx.array], shared) -> mx.array:
        routed = parts[0] if len(parts) == 1 else mx.concatenate(list(parts), axis=1)
        sw = self.params.layers[x.layer].shared
        return combine(x.x_mid, routed, shared, x.h, sw.gate_inp if sw is not None else None)

    def head(self, x: mx.array) -> np.ndarray:
        return np.array(head(self.params, x), dtype=np.float32)
