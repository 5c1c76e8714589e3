"""Full-size made models in MLX memory, for benchmarks: random float16 dense weights and random
*valid* Q2_0 expert records, generated on the device (no files, no GGUF).

The values are random (routing is noise-like, so streaming sees close to worst-case locality);
the byte counts, shapes and kernels are the real ones.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.formats.expert_record import RecordLayout
from strata.formats.quant_types import QuantType
from strata.mlx_backend.attention import AttentionWeights
from strata.mlx_backend.deltanet import DeltaNetWeights
from strata.mlx_backend.experts import SharedWeights
from strata.mlx_backend.kernels.dense_gemv import MAX_COLS
from strata.mlx_backend.mla import MlaWeights
from strata.mlx_backend.model import LayerWeights, MlxParams
from strata.mlx_backend.quants import MlxQuantMatrix
from strata.model_config import Ffn, LayerType, Mixer, ModelConfig, QKNorm, RoutingOrder
from strata.reference.routing import RouterRule

__all__ = ["SEED_SHAPE", "QWEN35_397B_SHAPE", "DEEPSEEK_V3_SHAPE", "random_params", "random_records", "q8_router",
           "random_mla", "selection_bias"]

RECORD_CHUNK = 1024  # records generated per step, at most CHUNK_BYTES of them
# randint's float32 and int32 temporaries are 8 bytes a code byte: 1024 of DeepSeek-V3's 13.8 MB
# records were a 14 GB step with up to ~110 GB of them alive (2 GiB: 156 of them; the seed's 1024 as before)
CHUNK_BYTES = 2 << 30

# The reference engine's model class (48 layers, 256 experts, top-10, shared expert) with experts of the
# seed's size: 3 x 2560 x 576 weights at 2.5 bits = 1.3824 MB of Q2_0 per expert.
SEED_SHAPE = ModelConfig(
    architecture="strata_test", vocab_size=32768, hidden_size=2560, n_layers=48, n_heads=16, n_kv_heads=4,
    head_dim=128, n_experts=256, n_experts_per_token=10, expert_ffn_size=576, shared_ffn_size=512,
    shared_expert_gated=True, qk_norm=QKNorm.PER_HEAD, max_context=4096,
)
# Qwen3.5-397B-A17B's per-layer shape (its config.json): 60 layers, every fourth full attention
# (gated, a quarter of the head rotary), the rest gated DeltaNet; 512 experts, top-10
QWEN35_397B_SHAPE = ModelConfig.from_dict(dict(
    architecture="strata_test", vocab_size=248320, hidden_size=4096, n_layers=60, n_heads=32, n_kv_heads=2,
    head_dim=256, n_experts=512, n_experts_per_token=10, expert_ffn_size=1024, shared_ffn_size=1024,
    shared_expert_gated=True, qk_norm=QKNorm.PER_HEAD, max_context=4096,
    layer_types=tuple(LayerType(Mixer.ATTENTION if (l + 1) % 4 == 0 else Mixer.DELTANET, Ffn.MOE) for l in range(60)),
    rotary_dim=64, attention_output_gate=True, linear_k_heads=16, linear_v_heads=64, linear_k_head_dim=128,
    linear_v_head_dim=128, linear_conv_kernel=4,
))

# DeepSeek-V3's per-layer shape (its config.json; Kimi-K2 differs in 384 experts, 64 heads, one
# dense layer): 61 layers, the first 3 dense (SwiGLU of 18432), then 256 routed experts of 2048 and
# one shared, top-8 by sigmoid scores with a selection bias in 8 groups of which the best 4 are
# eligible, weights normalised and scaled by 2.5; latent attention with a low-rank query
DEEPSEEK_V3_SHAPE = ModelConfig.from_dict(dict(
    architecture="strata_test", vocab_size=129280, hidden_size=7168, n_layers=61, n_heads=128, n_kv_heads=128,
    head_dim=192, n_experts=256, n_experts_per_token=8, expert_ffn_size=2048, shared_ffn_size=2048,
    shared_expert_gated=False, qk_norm=QKNorm.NONE, max_context=4096, routing_order=RoutingOrder.SIGMOID_TOPK,
    layer_types=tuple(LayerType(Mixer.MLA, Ffn.DENSE if l < 3 else Ffn.MOE) for l in range(61)),
    dense_ffn_size=18432, n_group=8, topk_group=4, routed_scaling_factor=2.5, router_bias=True,
    q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
))


def _normal(shape, std, key) -> mx.array:
    return (mx.random.normal(shape, key=key) * std).astype(mx.float16)


def random_records(rec: RecordLayout, n: int, key: mx.array, *, distinct: int = 0) -> mx.array:
    """n valid Q2_0 records (uint8 [n, padded_bytes]): random codes, scales in [1e-3, 2e-2].

    distinct: make only this many (a divisor of n) and repeat them. Concatenating n fresh
    records holds them twice at the peak (242 GB for Qwen3.5-397B's 30720); a repeated pool holds
    the arena once plus the pool. Values do not matter to a benchmark; distinct addresses do (a
    pool of two layers' experts is far past the L2)."""
    if rec.qtype is not QuantType.Q2_0:
        raise ValueError("random records are Q2_0")
    if 0 < distinct < n:
        if n % distinct:
            raise ValueError(f"random records: {distinct} distinct records do not divide {n}")
        pool = random_records(rec, distinct, key)
        out = mx.broadcast_to(pool[None], (n // distinct, distinct, rec.padded_bytes)).reshape(n, rec.padded_bytes)
        out = mx.contiguous(out)
        mx.eval(out)
        del pool
        return out
    chunks = []
    step = max(1, min(RECORD_CHUNK, CHUNK_BYTES // rec.padded_bytes))
    for c0 in range(0, n, step):  # bounded temporaries: a 48 x 256 arena is 17 GB
        m = min(step, n - c0)
        keys = mx.random.split(mx.random.split(key, (n + step - 1) // step)[c0 // step], 8)
        pieces, end = [], 0
        for i, span in enumerate(rec.planes):
            if span.offset > end:
                pieces.append(mx.zeros((m, span.offset - end), mx.uint8))
            if i % 2 == 0:  # codes: any byte is valid
                pieces.append(mx.random.randint(0, 256, (m, span.nbytes), key=keys[i]).astype(mx.uint8))
            else:  # float16 scales, viewed as bytes
                sc = mx.random.uniform(1e-3, 2e-2, (m, span.nbytes // 2), key=keys[i]).astype(mx.float16)
                pieces.append(sc.view(mx.uint8))
            end = span.offset + span.nbytes
        pieces.append(mx.zeros((m, rec.padded_bytes - end), mx.uint8))
        chunk = mx.concatenate(pieces, axis=1)
        mx.eval(chunk)
        chunks.append(chunk)
    out = chunks[0] if len(chunks) == 1 else mx.concatenate(chunks, axis=0)
    mx.eval(out)
    return out


def q8_router(e: int, d: int, key: mx.array) -> MlxQuantMatrix:
    """A random valid Q8_0 matrix [e, d] (the read-ahead router copy)."""
    k1, k2 = mx.random.split(key)
    codes = mx.random.randint(-127, 128, (e, d), key=k1).astype(mx.int8).view(mx.uint8)
    scales = mx.random.uniform(1e-3, 1e-2, (e, d // 32), key=k2).astype(mx.float16)
    q = (codes ^ 0x80).astype(mx.uint32).reshape(e, d // 4, 4)  # MLX's affine 8-bit: q + 128, LSB first
    w = q[..., 0] | (q[..., 1] << 8) | (q[..., 2] << 16) | (q[..., 3] << 24)
    sf = scales.astype(mx.float32)
    return MlxQuantMatrix(QuantType.Q8_0, e, d, w, sf, -128.0 * sf, codes, scales)


def random_params(cfg: ModelConfig = SEED_SHAPE, seed: int = 0, *, experts: bool = True,
                  pred_q8: bool = True, distinct_records: int = 0, expert_layout: RecordLayout | None = None) -> MlxParams:
    """MlxParams with random float16 dense weights (and, with `experts`, a resident arena of every
    expert, slot l*E + e; distinct_records: see `random_records`). expert_layout: records of
    llama.cpp's types instead of Q2_0 (strata.testing.ggml_records.ggml_layout)."""
    key = mx.random.key(seed)
    d, hd = cfg.hidden_size, cfg.head_dim
    qr, kr = cfg.n_heads * hd, cfg.n_kv_heads * hd
    layers = []
    layer_keys = mx.random.split(key, cfg.n_layers + 1)
    for l in range(cfg.n_layers):
        ks = mx.random.split(layer_keys[l], 10)
        ones = lambda n: mx.ones((n,), mx.float16)  # noqa: E731
        if cfg.kinds[l].mixer is Mixer.DELTANET:
            attn = random_deltanet(cfg, ks[0])
        elif cfg.kinds[l].mixer is Mixer.MLA:
            attn = random_mla(cfg, ks[0])
        else:
            gated = cfg.attention_output_gate  # the gate's rows under q, k, v (AttentionWeights)
            attn = AttentionWeights(ones(d), _normal((qr * (1 + int(gated)) + 2 * kr, d), d ** -0.5, ks[0]), None,
                                    ones(hd) if cfg.qk_norm is not QKNorm.NONE else None,
                                    ones(hd) if cfg.qk_norm is not QKNorm.NONE else None,
                                    _normal((d, qr), qr ** -0.5, ks[1]),
                                    gated)
        if cfg.kinds[l].ffn is Ffn.DENSE:  # a dense FFN layer: no router, no experts
            fd = cfg.dense_ffn_size
            dense = SharedWeights(_normal((fd, d), d ** -0.5, ks[2]), _normal((fd, d), d ** -0.5, ks[3]),
                                  _normal((d, fd), fd ** -0.5, ks[4]), None)
            layers.append(LayerWeights(attn, ones(d), None, None, None, dense))
            continue
        shared = None
        if cfg.has_shared_expert:
            fs = cfg.shared_ffn_size
            shared = SharedWeights(_normal((fs, d), d ** -0.5, ks[2]), _normal((fs, d), d ** -0.5, ks[3]),
                                   _normal((d, fs), fs ** -0.5, ks[4]),
                                   _normal((d,), d ** -0.5, ks[5]) if cfg.shared_expert_gated else None)
        router = (mx.random.normal((cfg.n_experts, d), key=ks[6]) * d ** -0.5).astype(mx.float32)
        guess = q8_router(cfg.n_experts, d, ks[7]) if pred_q8 else None
        bias = selection_bias(cfg, seed, l)
        layers.append(LayerWeights(attn, ones(d), router, guess, shared, rule=RouterRule.from_model_config(cfg).for_layer(bias)))
    kk = mx.random.split(layer_keys[-1], 3)
    embed = _normal((cfg.vocab_size, d), 1.0, kk[0])
    output = _normal((cfg.vocab_size, d), d ** -0.5, kk[1])
    arena = rec = None
    if experts and expert_layout is not None and expert_layout.qtype is not QuantType.Q2_0:
        from strata.testing.ggml_records import random_ggml_records

        rec = expert_layout
        arena = _DeviceArena(random_ggml_records(rec, cfg.n_moe_layers * cfg.n_experts, kk[2], distinct=distinct_records))
    elif experts:
        rec = RecordLayout(QuantType.Q2_0, d, cfg.expert_ffn_size)
        arena = _DeviceArena(random_records(rec, cfg.n_moe_layers * cfg.n_experts, kk[2], distinct=distinct_records))
    out_norm = mx.ones((d,), mx.float16)
    # every weight evaluated here: a lazy one would be recomputed into the first forward's graph
    # (the launch count of a decoded token, tests/mlx_backend/test_mlx_kernels.py, reads that graph)
    mx.eval(embed, output, out_norm, *[x for lw in layers for x in _weights(lw)])
    return MlxParams(cfg, tuple(layers), embed, out_norm, output, mx.float16, arena, rec)


def random_deltanet(cfg: ModelConfig, key: mx.array) -> DeltaNetWeights:
    """Random float16 DeltaNet weights of `cfg`'s sizes (decay parameters float32, decays < 1)."""
    dn = cfg.deltanet
    d, hv = cfg.hidden_size, dn.linear_v_heads
    v_dim = hv * dn.linear_v_head_dim
    c = 2 * dn.linear_k_heads * dn.linear_k_head_dim + v_dim
    ks = mx.random.split(key, 4)
    return DeltaNetWeights(mx.ones((d,), mx.float16), _normal((c + v_dim + 2 * hv, d), d ** -0.5, ks[0]),
                           _normal((c, dn.linear_conv_kernel), 0.5, ks[1]), -mx.random.uniform(1.0, 16.0, (hv,), key=ks[2]),
                           mx.zeros((hv,), mx.float32), mx.ones((dn.linear_v_head_dim,), mx.float16),
                           _normal((d, v_dim), v_dim ** -0.5, ks[3]))


def selection_bias(cfg: ModelConfig, seed: int, layer: int) -> np.ndarray | None:
    """The selection-only router bias random_params gives MoE layer `layer` (None without one):
    the streaming benchmark hands the same values to the runtime's routing."""
    return np.random.default_rng([seed, layer]).normal(0, 0.05, cfg.n_experts) if cfg.sigmoid.router_bias else None


def random_mla(cfg: ModelConfig, key: mx.array) -> MlaWeights:
    """Random float16 latent-attention weights of `cfg`'s sizes (norm weights 1)."""
    d, h, c, r = cfg.hidden_size, cfg.n_heads, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim
    n, v, ql = cfg.mla.qk_nope_head_dim, cfg.mla.v_head_dim, cfg.mla.q_lora_rank
    ks = mx.random.split(key, 5)
    q_in = ql or d
    wo_blocks = tuple(_normal((d, min(MAX_COLS, h * v - i)), (h * v) ** -0.5, k)
                      for i, k in zip(range(0, h * v, MAX_COLS), mx.random.split(ks[4], -(-h * v // MAX_COLS))))
    return MlaWeights(mx.ones((d,), mx.float16), _normal((ql + c + r, d), d ** -0.5, ks[0]),
                      mx.ones((ql,), mx.float16) if ql else None, _normal((h * (n + r), q_in), q_in ** -0.5, ks[1]),
                      mx.ones((c,), mx.float16), _normal((h, n, c), c ** -0.5, ks[2]), _normal((h, v, c), c ** -0.5, ks[3]),
                      wo_blocks)


def _weights(lw: LayerWeights) -> list[mx.array]:
    a, sh, g = lw.attn, lw.shared, lw.guess
    if lw.dense is not None:
        sh = lw.dense
    if isinstance(a, (DeltaNetWeights, MlaWeights)):
        out = a.arrays() + [w for w in (lw.ffn_norm, lw.router) if w is not None]
    else:
        out = [a.norm, a.wqkv, a.wo, lw.ffn_norm, lw.router] + [w for w in (a.bqkv, a.q_norm, a.k_norm)
                                                                if w is not None]
    if sh is not None:
        out += [w for w in (sh.gate, sh.up, sh.down, sh.gate_inp) if w is not None]
    if g is not None:
        out += [w for w in (g.codes, g.raw_scales, g.w, g.scales, g.biases) if w is not None]
    return out


class _DeviceArena:
    """An all-resident arena made on the device (never touched by the host: no managed-memory
    migration), with the `array` attribute the model reads."""

    def __init__(self, array: mx.array) -> None:
        self.array = array
        self.capacity, self.slot_bytes = array.shape

