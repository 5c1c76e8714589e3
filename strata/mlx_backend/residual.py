"""The residual stream as a strategy on MLX: the twin of strata.reference.residual.

model.py's forward and the streaming compute (compute.py) run one layer loop for every family;
how a layer's blocks read and write the residual is the strategy's, chosen by
`ModelConfig.residual` (`RESIDUALS`, a table like the mixers'):

- `PlainResidual` (every family but Qwen4-Exp): one stream [T, D] with pre-norms. Its adds live
  in the decode kernels: the router kernel adds the mixer's partials to x, norms and routes
  (`router_stage`), the expert launch or `combine` adds the FFN's output; an attention layer's
  router may ride in the attention launch (`fuse_router`), and the routed experts may add the
  residual themselves (`fuses_residual`: decode_experts.py).
- `HyperConnections` (Qwen4-Exp): hc streams [T, S], S = hc * D, each block between a read and a
  write of its own hyper-connection (`hc_read`, `hc_write`), the PLE term first on PLE layers
  (ple.py); the mixers are the table's (mixers.py: the block input comes normed, so a DeltaNet
  layer holds no attn_norm); MLX ops only (`ops_only` says so to the compiled step, the prompt
  path and the device pipeline).

A strategy's steps, as the reference's: `expand` (embedding -> residual), `mixer_block` (the
layer's mixer applied; what it returns `ffn_read` reads), `ffn_read` (the FFN input h, router
logits z, the read-ahead guess g and the carry `ffn_write` needs), `ffn_write` (the MoE output
written back), `head`. Its static parts: the dtype its dense weights are held in (dense.py's
table), `layer_weights` / `head_weights` (what the residual itself holds) and `empty_layer_state`.
Dense weights are held as stored (dense.py) whatever the residual.

Shapes: T positions, D hidden, S = hc * D streams, E experts, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import mlx.core as mx
import numpy as np

from strata.formats.dense_weights import as_dense_weights
from strata.families.qwen4_exp import HC_FINAL, Qwen4Names, ple_layers
from strata.mlx_backend.attention import attention_router, rms_norm, routes_with_attention
from strata.mlx_backend.dense import Weight, held_column_blocks, linear, project
from strata.mlx_backend.dense import held as held_weight
from strata.mlx_backend.experts import combine, shared_partials
from strata.mlx_backend.kernels import dense_gemv as dense_kernel
from strata.mlx_backend.kernels import router as router_kernel
from strata.mlx_backend.kernels.launch import KernelPath, current_path
from strata.mlx_backend.mixers import mixer_for
from strata.mlx_backend.ple import PleWeights, empty_ple_state, grouped_rms_norm, ple
from strata.mlx_backend.quants import MlxQuantMatrix, gemv
from strata.model_config import ModelConfig, ResidualKind, TensorNames
from strata.reference.attention import KVPrecision
from strata.reference.ngram_rows import NgramRows
from strata.reference.ple import PleLayerState, resident_rows

__all__ = ["HcWeights", "HyperLayerWeights", "hc_read", "hc_write", "PlainResidual", "HyperConnections", "RESIDUALS",
           "residual_for", "router_stage", "ffn_input", "dense_ffn", "head"]


# ---------------------------------------------------------------- the plain stream's pieces


def _router_kernel_ok(p) -> bool:
    # the router kernel computes W h only: a router with a logit bias (gpt-oss) takes MLX ops
    return (current_path() is not KernelPath.OPS and p.dtype == mx.float16 and p.cfg.hidden_size % 32 == 0
            and not p.cfg.gpt_oss.router_logit_bias)


def _routes_with_mixer(p, layer: int, kv, t: int) -> bool:
    """Whether the layer's attention and its router (the kernel, no guess) run as one launch."""
    return (mixer_for(p.cfg.kinds[layer].mixer).softmax_attention and _router_kernel_ok(p)
            and routes_with_attention(p.cfg, p.layers[layer].attn, kv, t))


def router_stage(p, layer: int, x: mx.array, parts: mx.array, guess: MlxQuantMatrix | None = None
                 ) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
    """The residual after attention, the router input h, router logits z, and (with `guess`, the
    next layer's Q8_0 router) the read-ahead guess logits.

    Shapes:
        x [T, D], parts [T, P, D] -> x_mid [T, D], h [T, D], z float32 [T, E], g [T, E] or None
    """
    lw, cfg = p.layers[layer], p.cfg
    if _router_kernel_ok(p):
        g_codes = guess.codes if guess is not None else None
        g_scales = guess.raw_scales if guess is not None else None
        x_mid, h, z, g = router_kernel.router(x, parts, lw.ffn_norm, lw.router, g_codes, g_scales, cfg.rms_norm_eps)
        return x_mid, h, z, (g if guess is not None else None)
    x_mid = x + parts.sum(axis=1)
    h = rms_norm(x_mid, lw.ffn_norm, cfg.rms_norm_eps)
    z = h @ lw.router.T
    g = gemv(guess, h) if guess is not None else None
    if lw.router_logit_bias is not None:  # this layer's logit bias; g is the next layer's W h (MlxCompute adds its bias)
        z = z + lw.router_logit_bias
    return x_mid, h, z, g


def ffn_input(p, layer: int, x: mx.array, parts: mx.array) -> tuple[mx.array, mx.array]:
    """A dense FFN layer's residual after its mixer and its FFN input h (no router: MLX ops).

    Shapes:
        x [T, D], parts [T, P, D] -> x_mid [T, D], h [T, D]
    """
    x_mid = x + parts.sum(axis=1)
    return x_mid, rms_norm(x_mid, p.layers[layer].ffn_norm, p.cfg.rms_norm_eps)


def dense_ffn(p, layer: int, x_mid: mx.array, h: mx.array) -> mx.array:
    """x + ffn(h) for a dense FFN layer (the shared-expert body without its gate). [T, D] -> [T, D]"""
    return x_mid + shared_partials(h, p.layers[layer].dense).sum(axis=1)


def head(p, x: mx.array) -> mx.array:
    """Twin of reference `head`: final norm and LM head. [T, D] -> float32 [T, V]

    Kernel path: one launch (the norm fused into the head GEMV; the ops path takes nine)."""
    d = p.cfg.hidden_size
    if (current_path() is not KernelPath.OPS and p.output.dtype == mx.float16 and p.out_norm.dtype == mx.float16
            and d % 8 == 0 and d <= dense_kernel.MAX_COLS):
        return dense_kernel.dense_gemv(p.output, x, p.out_norm, p.cfg.rms_norm_eps)
    xn = rms_norm(x, p.out_norm, p.cfg.rms_norm_eps)
    return linear(xn, p.output)


@dataclass(eq=False)
class Mixed:
    """A plain layer after its mixer: the residual in and the mixer's partials [T, P, D]; or, where
    the router rode in the attention launch, the residual after attention, h and z already."""

    x: mx.array
    parts: mx.array | None
    x_mid: mx.array | None = None
    h: mx.array | None = None
    z: mx.array | None = None


def _vector(dense: Mapping[str, np.ndarray], name: str, dtype: mx.Dtype) -> mx.array:
    return mx.array(np.asarray(dense[name], np.float32)).astype(dtype)


class PlainResidual:
    """One stream with pre-norms; the adds inside the decode kernels (module doc)."""

    fuses_residual = True  # the routed experts' launch may add the residual (decode_experts.routed_residual)
    ops_only: str | None = None

    @staticmethod
    def dtype(default: mx.Dtype) -> mx.Dtype:
        return default  # float16 on a kernel path, float32 on the ops path (model.default_dtype)

    @staticmethod
    def layer_weights(cfg: ModelConfig, dense, layer: int, dtype: mx.Dtype) -> tuple[mx.array, None]:
        """(the FFN's pre-norm [D], nothing else)."""
        return _vector(dense, TensorNames.block(layer, TensorNames.ffn_norm), dtype), None

    @staticmethod
    def head_weights(cfg: ModelConfig, dense, dtype: mx.Dtype) -> tuple[mx.array, None]:
        """(the final norm [D], no last hyper-connection)."""
        return _vector(dense, TensorNames.output_norm, dtype), None

    @staticmethod
    def empty_layer_state(cfg: ModelConfig, layer: int, kv_precision: KVPrecision = KVPrecision.F32):
        return mixer_for(cfg.kinds[layer].mixer, layer).empty_state(cfg, kv_precision)

    @staticmethod
    def rows_for(cfg: ModelConfig, dense, rows: NgramRows | None) -> None:
        return None

    @staticmethod
    def with_rows(rows: NgramRows | None) -> "PlainResidual":
        return PLAIN

    def expand(self, p, x: mx.array, tokens: np.ndarray) -> mx.array:
        return x

    def mixer_block(self, p, layer: int, state, r: mx.array, tokens: np.ndarray, *, pos: mx.array | None = None,
                    window: bool = False, mix=None, fuse_router: bool = False, hand_on: bool = False):
        """The mixer's partials, lazily (the router kernel adds them), or with fuse_router (an MoE
        layer's forward) the attention and its router in one launch where it can. mix: the
        partials function (p, layer, state, x, *, window) to use (the prompt path's; default the
        layer's mixer from the table, mixers.py)."""
        lw = p.layers[layer]
        if fuse_router and _routes_with_mixer(p, layer, state, r.shape[0]):
            # h and z handed to the expert launch in the attention launch's buffer (attend_project.routed_chain)
            x_mid, h, z, state = attention_router(p.cfg, lw.attn, state, r, lw.ffn_norm, lw.router, pos=pos,
                                                  hand_on=hand_on)
            return Mixed(r, None, x_mid, h, z), state
        if mix is None:
            parts, state = mixer_for(p.cfg.kinds[layer].mixer, layer).partials(p.cfg, lw.attn, state, r, pos=pos,
                                                                               window=window)
        else:
            parts, state = mix(p, layer, state, r, window=window)
        return Mixed(r, parts), state

    def ffn_read(self, p, layer: int, m: Mixed, guess: MlxQuantMatrix | None = None):
        """(h, z, g, carry): z and g None on a dense FFN layer; carry the residual after the mixer."""
        if m.h is not None:
            return m.h, m.z, None, m.x_mid
        if p.layers[layer].router is None:
            x_mid, h = ffn_input(p, layer, m.x, m.parts)
            return h, None, None, x_mid
        x_mid, h, z, g = router_stage(p, layer, m.x, m.parts, guess)
        return h, z, g, x_mid

    def ffn_write(self, p, layer: int, carry: mx.array, routed: mx.array, shared, h: mx.array) -> mx.array:
        sw = p.layers[layer].shared
        return combine(carry, routed, shared, h, sw.gate_inp if sw is not None else None)

    def head(self, p, r: mx.array) -> mx.array:
        return head(p, r)


PLAIN = PlainResidual()


# ---------------------------------------------------------------- hyper-connections


@dataclass(frozen=True, eq=False)
class HcWeights:
    """The matrices as stored (dense.py); down and inject, which read every stream, in one block of
    columns per stream (each within what `project`'s GEMV reads). Shapes: norm float32 [S];
    down hc x [r, D]; up [S, r]; inject hc x [hc, D], or None (before the head)."""

    norm: mx.array
    down: tuple[Weight, ...]
    up: Weight
    inject: tuple[Weight, ...] | None

    def arrays(self) -> list:
        return [self.norm, *self.down, self.up, *(self.inject or ())]


@dataclass(frozen=True, eq=False)
class HyperLayerWeights:
    """A layer's hyper-connections around its mixer and its FFN, and its PLE module (PLE layers)."""

    hc_attn: HcWeights
    hc_ffn: HcWeights
    ple: PleWeights | None

    def arrays(self) -> list:
        return self.hc_attn.arrays() + self.hc_ffn.arrays() + (self.ple.arrays() if self.ple is not None else [])


def _hc_weights(cfg: ModelConfig, dense, prefix: str, dtype: mx.Dtype, inject: bool = True) -> HcWeights:
    q, stored = Qwen4Names, as_dense_weights(dense).stored
    per_stream = lambda part: held_column_blocks(stored(q.hc(prefix, part)), dtype, cfg.hidden_size)  # noqa: E731
    return HcWeights(_vector(dense, q.hc(prefix, q.hc_norm), mx.float32), per_stream(q.hc_down),
                     held_weight(stored(q.hc(prefix, q.hc_up)), dtype), per_stream(q.hc_inject) if inject else None)


def _over_streams(normed: mx.array, blocks: tuple[Weight, ...], d: int) -> mx.array:
    """normed @ W.T for W held as one column block per stream: the streams' products summed.
    normed [T, S] -> [T, R]"""
    out = project(normed[:, :d], blocks[0])
    for i, w in enumerate(blocks[1:], 1):
        out = out + project(normed[:, i * d:(i + 1) * d], w)
    return out


def hc_read(cfg: ModelConfig, w: HcWeights, streams: mx.array) -> tuple[mx.array, mx.array | None]:
    """Twin of reference `hc_read`. streams [T, S] -> (input [T, D], inject [T, hc] or None)"""
    hc, d, t = cfg.qwen4.hc_count, cfg.hidden_size, streams.shape[0]
    normed = grouped_rms_norm(streams, w.norm, d, cfg.rms_norm_eps)
    low = _over_streams(normed, w.down, d) / hc
    mix = mx.sigmoid(project(low * mx.sigmoid(low), w.up))
    block_input = (mix * normed).reshape(t, hc, d).mean(axis=1)
    if w.inject is None:
        return block_input, None
    return block_input, 2.0 * mx.sigmoid(_over_streams(normed, w.inject, d) / hc)


def hc_write(streams: mx.array, inject: mx.array, out: mx.array) -> mx.array:
    """Twin of reference `hc_write`. streams [T, S], inject [T, hc], out [T, D] -> [T, S]"""
    t, hc = inject.shape
    return streams + (inject[:, :, None] * out[:, None, :]).reshape(t, -1)


class HyperConnections:
    """hc streams, a hyper-connection around each block (module doc). rows: the PLE layers' n-gram
    row source. MLX ops; dense weights as stored, held at float32 where a file stores float32
    (no float16 rounding: the kernels that read float16 do not serve this residual yet)."""

    fuses_residual = False
    ops_only = "hyper-connection streams (their forward is MLX ops: no compiled step, prompt path or device pipeline)"

    def __init__(self, rows: NgramRows) -> None:
        self.rows = rows

    @staticmethod
    def dtype(default: mx.Dtype) -> mx.Dtype:
        return mx.float32

    @staticmethod
    def layer_weights(cfg: ModelConfig, dense, layer: int, dtype: mx.Dtype) -> tuple[None, HyperLayerWeights]:
        """(no pre-norm: the hyper-connection norms, the layer's hyper-connection weights)."""
        n, q = TensorNames, Qwen4Names
        b = lambda s: n.block(layer, s)  # noqa: E731
        ple_w = None
        if layer in ple_layers(cfg):
            stored = as_dense_weights(dense).stored
            m = lambda s: held_weight(stored(b(s)), dtype)  # noqa: E731  as stored
            v = lambda s: _vector(dense, b(s), mx.float32)  # noqa: E731
            ple_w = PleWeights(m(q.ple_key), m(q.ple_value), v(q.ple_key_norm), v(q.ple_query_norm),
                               v(q.ple_conv_norm), m(q.ple_conv))
        return None, HyperLayerWeights(_hc_weights(cfg, dense, b("hc_attn"), dtype),
                                       _hc_weights(cfg, dense, b("hc_ffn"), dtype), ple_w)

    @staticmethod
    def head_weights(cfg: ModelConfig, dense, dtype: mx.Dtype) -> tuple[None, HcWeights]:
        """(no final norm: the last hyper-connection norms, that hyper-connection's weights)."""
        return None, _hc_weights(cfg, dense, HC_FINAL, dtype, inject=False)

    @staticmethod
    def empty_layer_state(cfg: ModelConfig, layer: int, kv_precision: KVPrecision = KVPrecision.F32):
        """The mixer's state, and on a PLE layer (a DeltaNet layer) its PLE module's beside it."""
        state = mixer_for(cfg.kinds[layer].mixer, layer).empty_state(cfg, kv_precision)
        return PleLayerState(state, empty_ple_state(cfg, layer)) if layer in ple_layers(cfg) else state

    @staticmethod
    def rows_for(cfg: ModelConfig, dense, rows: NgramRows | None) -> NgramRows:
        """rows, or the n-gram tables held with the dense weights."""
        return rows if rows is not None else resident_rows(cfg, dense)

    @staticmethod
    def with_rows(rows: NgramRows | None) -> "HyperConnections":
        if rows is None:
            raise ValueError("hyper-connections read PLE rows: pass the row source (HyperConnections.rows_for)")
        return HyperConnections(rows)

    def expand(self, p, x: mx.array, tokens: np.ndarray) -> mx.array:
        return mx.concatenate([x] * p.cfg.qwen4.hc_count, axis=1)  # [T, S]

    def mixer_block(self, p, layer: int, state, r: mx.array, tokens: np.ndarray, *, pos: mx.array | None = None,
                    window: bool = False, mix=None, fuse_router: bool = False, hand_on: bool = False):
        """The PLE term (on PLE layers) and the mixer with its hyper-connection. [T, S] -> ([T, S], state)
        (MLX ops: pos, mix, fuse_router and hand_on, the plain stream's kernel options, do not apply.)"""
        cfg, lw = p.cfg, p.layers[layer]
        hw, mixer = lw.hyper, mixer_for(cfg.kinds[layer].mixer, layer)
        if isinstance(state, PleLayerState):
            extra, ple_state = ple(cfg, hw.ple, layer, self.rows, state.ple, r, tokens, window=window)
            r = r + extra
            a, inject = hc_read(cfg, hw.hc_attn, r)
            parts, mixer_state = mixer.partials(cfg, lw.attn, state.mixer, a, window=window)
            return hc_write(r, inject, parts.sum(axis=1)), PleLayerState(mixer_state, ple_state)
        a, inject = hc_read(cfg, hw.hc_attn, r)
        parts, state = mixer.partials(cfg, lw.attn, state, a, window=window)
        return hc_write(r, inject, parts.sum(axis=1)), state

    def ffn_read(self, p, layer: int, r: mx.array, guess: MlxQuantMatrix | None = None):
        """(h [T, D], z [T, E], g or None, carry: the streams and each stream's share of the FFN output)."""
        lw = p.layers[layer]
        h, inject = hc_read(p.cfg, lw.hyper.hc_ffn, r)
        z = h @ lw.router.T
        return h, z, (gemv(guess, h) if guess is not None else None), (r, inject)

    def ffn_write(self, p, layer: int, carry, routed: mx.array, shared, h: mx.array) -> mx.array:
        streams, inject = carry
        moe = combine(mx.zeros_like(h), routed, shared, h, p.layers[layer].shared.gate_inp)
        return hc_write(streams, inject, moe)

    def head(self, p, r: mx.array) -> mx.array:
        """The last hyper-connection and the LM head. [T, S] -> float32 [T, V]"""
        final, _ = hc_read(p.cfg, p.hc_out, r)
        return project(final, p.output)


# each residual kind's strategy; `with_rows(rows)` builds it
RESIDUALS: dict[ResidualKind, type] = {
    ResidualKind.PLAIN: PlainResidual,
    ResidualKind.HYPER_CONNECTIONS: HyperConnections,
}


def residual_for(cfg: ModelConfig, rows: NgramRows | None = None):
    """The model's residual strategy, by its kind. rows: the PLE row source hyper-connections read
    (`rows_for` gives the default from the dense weights)."""
    return RESIDUALS[cfg.residual].with_rows(rows)
