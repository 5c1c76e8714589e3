"""Qwen4-Exp's part of the model config: its fields (`Qwen4Config`, `ModelConfig.qwen4`), its
tensors (names, shapes) and the rules its fields keep.

A Qwen4-Exp model (`cfg.qwen4.hc_count > 0`) has no pre-norms: every layer's residual is
`hc_count` streams of width D, and a hyper-connection (reference/hyper_connections.py) with its
own grouped RMSNorm reads them before the mixer and before the MoE block, and a last one before
the head. Its full-attention layers are `Mixer.INDEXED_ATTENTION` (gated attention plus a QSA
indexer, reference/indexed_attention.py); some DeltaNet layers carry a PLE module
(reference/ple.py) whose n-gram table is the layer's largest tensor.

Shapes use S = hc_count * D (every stream), r = hc_lowrank, E = ple_embed_dim,
N = (ngram_size - 1) * ngram_heads_per_order n-gram heads, Hi / di the indexer heads and width.
Below model_config (whose part it is): it imports only errors, the families' shared pieces
(family, qwen_hybrid's made DeltaNet sizes), layer_kinds and tensor_names.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from strata.errors import ConfigError
from strata.families.family import MADE_VOCAB, FamilyParts
from strata.families.qwen_hybrid import MADE_DELTANET

from strata.layer_kinds import Ffn, LayerType, Mixer, QKNorm
from strata.tensor_names import MIXER_TENSORS, TensorNames

if TYPE_CHECKING:  # annotations only: model_config imports this module for its checks and tensors
    from strata.model_config import ModelConfig

@dataclass(frozen=True)
class Qwen4Config:
    """Qwen4-Exp's own fields (`ModelConfig.qwen4`): hyper-connections, indexed (QSA) attention,
    PLE n-gram embeddings. At their "not Qwen4-Exp" defaults (hc_count 0: a plain residual)."""

    hc_count: int = 0  # residual streams (0: a plain residual with pre-norms)
    hc_lowrank: int = 0  # rank of the hyper-connection input mixer
    indexer_heads: int = 0  # QSA indexer query heads (one key head)
    indexer_head_dim: int = 0
    indexer_budget: int = 0  # tokens taken from complete key blocks per query
    indexer_block: int = 0  # tokens per compressed key block (transformers' indexer_compress_ratio)
    ple_layer_ids: str = ""  # comma-separated model layers (0-based) with a PLE module ("": none)
    ple_embed_dim: int = 0  # every n-gram head's row, concatenated
    ple_conv_kernel: int = 0  # taps of the dilated depthwise conv (dilation ngram_size)
    ngram_size: int = 0  # the largest n-gram hashed (orders 2..ngram_size)
    ngram_heads_per_order: int = 0
    ngram_vocab_base: int = 0  # head tables are successive primes from this one
    ngram_vocab_divisor: int = 1  # a layer's table rows are padded to a multiple of it
    ngram_seed: int = 0  # seeds the per-layer hash multipliers
    ngram_eos_token: int = 0  # the n-gram shifts stop at this token
    # the hash constants as a file stores them (llama.cpp's `ple.layer_multipliers`,
    # `ple.head_vocab_sizes`, `ple.head_offsets`): per PLE layer a comma-separated list, the layers'
    # lists joined by ";". "": derived from ngram_seed and ngram_vocab_base (stored_hash_constants)
    ngram_multipliers: str = ""
    ngram_head_sizes: str = ""
    ngram_head_offsets: str = ""
    ngram_table_rows: int = 0  # every PLE table's rows as stored (0: its heads' rows padded to ngram_vocab_divisor)
    # the DeltaNet's gated RMSNorm multiplies by sigmoid(z), not silu(z) (the released
    # Qwen3.8-Flash-Next's `output_gate_type: "sigmoid"`; llama.cpp's qwen4exp graph)
    deltanet_sigmoid_gate: bool = False
    # the n-gram tables are in the row store `<name>.ngrams` (docs/formats.md §7), not among the
    # dense tensors: what `strata convert` writes; the made test models may keep them dense
    ple_row_store: bool = False


HC_FINAL = "hc_output"  # the prefix of the hyper-connection before the head
# the mixers of a Qwen4-Exp layer (each layer is one of them, with an MoE block)
QWEN4_MIXERS = frozenset({Mixer.DELTANET, Mixer.INDEXED_ATTENTION})


class Qwen4Names:
    """Tensor names of the Qwen4-Exp parts (llama.cpp-like spelling); numpy shapes [out, in]."""

    # a hyper-connection: `hc_attn` (before the mixer), `hc_ffn` (before the MoE block), HC_FINAL
    @staticmethod
    def hc(prefix: str, part: str) -> str:
        return f"{prefix}_{part}.weight"

    hc_norm = "norm"  # [S]: the grouped RMSNorm (1 + w folded in), one D-group per stream
    hc_down = "down"  # [r, S]
    hc_up = "up"  # [S, r]
    hc_inject = "inject"  # [hc_count, S]: how much of the block's output each stream takes
    # the QSA indexer of an indexed-attention layer
    idx_qk = "idx_qk.weight"  # [(Hi + 1) di, D]: Hi query heads, then the one key head
    idx_q_norm = "idx_q_norm.weight"  # [di]
    idx_k_norm = "idx_k_norm.weight"  # [di]: applied to each block's mean key
    # a PLE module (on DeltaNet layers)
    ple_key = "ple_key.weight"  # [S, E]
    ple_value = "ple_value.weight"  # [D, E]
    ple_key_norm = "ple_key_norm.weight"  # [S]
    ple_query_norm = "ple_query_norm.weight"  # [S]
    ple_conv_norm = "ple_conv_norm.weight"  # [S]
    ple_conv = "ple_conv.weight"  # [S, ple_conv_kernel]: depthwise, dilation ngram_size
    ple_ngram = "ple_ngram.weight"  # [rows, E / N]: the hashed n-gram table (every head's rows)


def ple_layers(cfg: "ModelConfig") -> tuple[int, ...]:
    """The model layers (0-based, ascending) that carry a PLE module."""
    text = cfg.qwen4.ple_layer_ids.strip()
    return tuple(int(t) for t in text.split(",")) if text else ()


def ngram_heads(cfg: "ModelConfig") -> int:
    """N: hashed heads per PLE layer (heads_per_order for each order 2..ngram_size)."""
    return (cfg.qwen4.ngram_size - 1) * cfg.qwen4.ngram_heads_per_order


@functools.lru_cache(maxsize=8)
def primes_from(base: int, count: int) -> tuple[int, ...]:
    """The first `count` primes >= base (a segmented sieve: the real config asks for ~600 primes
    past 2e7, which trial division one by one, as transformers does, takes minutes)."""
    found: list[int] = []
    lo = max(base, 2)
    span = max(1024, count * max(8, int(math.log(lo + 2) * 2)))
    while len(found) < count:
        hi = lo + span
        sieve = np.ones(span, bool)
        for p in range(2, math.isqrt(hi) + 1):
            start = max(p * p, -(-lo // p) * p)
            sieve[start - lo::p] = False
        found.extend(int(lo + i) for i in np.flatnonzero(sieve))
        lo = hi
    return tuple(found[:count])


@dataclass(frozen=True)
class StoredHashConstants:
    """One PLE layer's hash constants as the file holds them. Shapes: multipliers [ngram_size],
    head_sizes / head_offsets [N]"""

    multipliers: np.ndarray
    head_sizes: np.ndarray
    head_offsets: np.ndarray


STORED_HASH_FIELDS = ("ngram_multipliers", "ngram_head_sizes", "ngram_head_offsets")


def _stored_lists(cfg: "ModelConfig", name: str) -> list[np.ndarray]:
    """A stored constant field split per PLE layer (";") into int64 arrays (",")."""
    text = getattr(cfg.qwen4, name).strip()
    return [np.asarray([int(v) for v in group.split(",")], np.int64) for group in text.split(";")] if text else []


def stored_hash_constants(cfg: "ModelConfig", ple_index: int) -> StoredHashConstants | None:
    """The hash constants the file stores for PLE layer `ple_index`; None where the config derives
    them (no ngram_multipliers). check_qwen4_fields has checked their counts."""
    if not cfg.qwen4.ngram_multipliers.strip():
        return None
    m, sizes, offsets = (_stored_lists(cfg, name)[ple_index] for name in STORED_HASH_FIELDS)
    return StoredHashConstants(m, sizes, offsets)


def hash_constant_fields(layers: list[StoredHashConstants]) -> dict[str, str]:
    """The config fields (STORED_HASH_FIELDS) that store these constants, one per PLE layer in order."""
    text = lambda arrays: ";".join(",".join(str(int(v)) for v in a) for a in arrays)  # noqa: E731
    return {"ngram_multipliers": text([c.multipliers for c in layers]),
            "ngram_head_sizes": text([c.head_sizes for c in layers]),
            "ngram_head_offsets": text([c.head_offsets for c in layers])}


def padded_rows(cfg: "ModelConfig", used: int) -> int:
    """A table's rows for heads that use rows [0, used): ngram_table_rows where stored, else
    `used` padded to ngram_vocab_divisor."""
    if cfg.qwen4.ngram_table_rows:
        return cfg.qwen4.ngram_table_rows
    return -(-used // cfg.qwen4.ngram_vocab_divisor) * cfg.qwen4.ngram_vocab_divisor


def derived_table_sizes(cfg: "ModelConfig", ple_index: int) -> tuple[np.ndarray, np.ndarray]:
    """Each head's prime size and offset as derived from the config: every head of every PLE layer
    has its own prime, the successive primes from ngram_vocab_base, layer by layer.
    -> (sizes int64 [N], offsets int64 [N])"""
    heads = ngram_heads(cfg)
    # every PLE layer's primes at once (one cached sieve per config, not one per layer)
    every = primes_from(cfg.qwen4.ngram_vocab_base, max(len(ple_layers(cfg)), ple_index + 1) * heads)
    sizes = np.asarray(every[ple_index * heads:(ple_index + 1) * heads], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return sizes, offsets


def ngram_table_sizes(cfg: "ModelConfig", ple_index: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A PLE layer's table: each head's size and offset (stored, else derived_table_sizes), and its
    rows (padded_rows). -> (sizes int64 [N], offsets int64 [N], rows)"""
    stored = stored_hash_constants(cfg, ple_index)
    sizes, offsets = (stored.head_sizes, stored.head_offsets) if stored else derived_table_sizes(cfg, ple_index)
    return sizes, offsets, padded_rows(cfg, int((sizes + offsets).max()))


def hc_shapes(cfg: "ModelConfig", prefix: str, *, inject: bool = True) -> dict[str, tuple[int, ...]]:
    q, s = Qwen4Names, cfg.qwen4.hc_count * cfg.hidden_size
    shapes = {q.hc(prefix, q.hc_norm): (s,), q.hc(prefix, q.hc_down): (cfg.qwen4.hc_lowrank, s),
              q.hc(prefix, q.hc_up): (s, cfg.qwen4.hc_lowrank)}
    if inject:
        shapes[q.hc(prefix, q.hc_inject)] = (cfg.qwen4.hc_count, s)
    return shapes


def qwen4_tensor_shapes(cfg: "ModelConfig") -> dict[str, tuple[int, ...]]:
    """Every dense tensor of a Qwen4-Exp model with its shape (model_config.dense_tensor_shapes)."""
    n, q, d = TensorNames, Qwen4Names, cfg.hidden_size
    s = cfg.qwen4.hc_count * d
    shapes: dict[str, tuple[int, ...]] = {n.token_embd: (cfg.vocab_size, d)}
    if not cfg.tie_embeddings:
        shapes[n.output] = (cfg.vocab_size, d)
    shapes.update(hc_shapes(cfg, HC_FINAL, inject=False))
    ple = ple_layers(cfg)
    for layer in range(cfg.n_layers):
        b = lambda name: n.block(layer, name)  # noqa: E731
        shapes.update(hc_shapes(cfg, b("hc_attn")))
        shapes.update(hc_shapes(cfg, b("hc_ffn")))
        shapes.update(MIXER_TENSORS[cfg.kinds[layer].mixer](cfg, layer))
        if cfg.kinds[layer].mixer is Mixer.INDEXED_ATTENTION:  # its indexer
            hi, di = cfg.qwen4.indexer_heads, cfg.qwen4.indexer_head_dim
            shapes.update({b(q.idx_qk): ((hi + 1) * di, d), b(q.idx_q_norm): (di,), b(q.idx_k_norm): (di,)})
        if layer in ple:
            e, k = cfg.qwen4.ple_embed_dim, cfg.qwen4.ple_conv_kernel
            rows = ngram_table_sizes(cfg, ple.index(layer))[2]
            shapes.update({b(q.ple_key): (s, e), b(q.ple_value): (d, e), b(q.ple_key_norm): (s,),
                           b(q.ple_query_norm): (s,), b(q.ple_conv_norm): (s,), b(q.ple_conv): (s, k)})
            if not cfg.qwen4.ple_row_store:  # else the table is in the row store, not the model file
                shapes[b(q.ple_ngram)] = (rows, e // ngram_heads(cfg))
        shapes[b(n.router)] = (cfg.n_experts, d)
        shapes[b(n.shexp_gate)] = (cfg.shared_ffn_size, d)
        shapes[b(n.shexp_up)] = (cfg.shared_ffn_size, d)
        shapes[b(n.shexp_down)] = (d, cfg.shared_ffn_size)
        shapes[b(n.shexp_gate_inp)] = (d,)
    return shapes


def check_qwen4_fields(cfg: "ModelConfig") -> None:
    """The Qwen4-Exp fields' rules, one ConfigError naming the field (nothing when hc_count is 0)."""
    q = cfg.qwen4
    indexed = [layer for layer, t in enumerate(cfg.kinds) if t.mixer is Mixer.INDEXED_ATTENTION]
    if q.deltanet_sigmoid_gate and not any(t.mixer is Mixer.DELTANET for t in cfg.kinds):
        raise ConfigError("model config: deltanet_sigmoid_gate is set, but no layer is a DeltaNet")
    if not q.hc_count:  # (the DeltaNet's gate is the one field a model of DeltaNet layers may set alone)
        if indexed or q.ple_layer_ids:
            raise ConfigError("model config: indexed attention and PLE layers need hc_count > 0 (Qwen4-Exp)")
        return
    if q.hc_count < 2 or q.hc_lowrank <= 0:
        raise ConfigError(f"model config: hc_count must be > 1 and hc_lowrank > 0, got {q.hc_count}, "
                          f"{q.hc_lowrank}")
    bad = [t.to_str() for t in cfg.kinds if t.mixer not in QWEN4_MIXERS or t.ffn is not Ffn.MOE]
    if bad:
        raise ConfigError(f"model config: layer_types {bad[0]!r}: Qwen4-Exp layers are deltanet or "
                          "indexed_attention, each with an MoE block")
    if not cfg.shared_ffn_size or not cfg.shared_expert_gated:
        raise ConfigError("model config: shared_ffn_size: Qwen4-Exp has a gated shared expert")
    if indexed:
        for name in ("indexer_heads", "indexer_head_dim", "indexer_budget", "indexer_block"):
            if getattr(q, name) <= 0:
                raise ConfigError(f"model config: indexed attention needs {name} > 0, got {getattr(q, name)}")
        if q.indexer_budget % q.indexer_block:
            raise ConfigError(f"model config: indexer_budget={q.indexer_budget} is not a multiple of "
                              f"indexer_block={q.indexer_block}")
        if cfg.rope_dim > q.indexer_head_dim:
            raise ConfigError(f"model config: indexer_head_dim={q.indexer_head_dim} must hold the "
                              f"{cfg.rope_dim} rotary dims")
    try:
        layers = ple_layers(cfg)
    except ValueError:
        raise ConfigError(f"model config: ple_layer_ids must be comma-separated layers, got {q.ple_layer_ids!r}")
    if not layers:
        if q.ple_row_store:
            raise ConfigError("model config: ple_row_store is set, but ple_layer_ids names no PLE layer")
        return
    deltanet = {l for l, t in enumerate(cfg.kinds) if t.mixer is Mixer.DELTANET}
    if list(layers) != sorted(set(layers)) or not set(layers) <= deltanet:
        raise ConfigError(f"model config: ple_layer_ids {q.ple_layer_ids!r} must be ascending DeltaNet layers")
    derived = ("ngram_vocab_base",) if not q.ngram_multipliers.strip() else ()  # the primes' start
    for name in ("ple_embed_dim", "ple_conv_kernel", "ngram_heads_per_order", "ngram_vocab_divisor") + derived:
        if getattr(q, name) <= 0:
            raise ConfigError(f"model config: PLE layers need {name} > 0, got {getattr(q, name)}")
    if q.ngram_size < 2:
        raise ConfigError(f"model config: PLE layers need ngram_size >= 2, got {q.ngram_size}")
    if q.ple_embed_dim % ngram_heads(cfg):
        raise ConfigError(f"model config: ple_embed_dim={q.ple_embed_dim} is not a multiple of the "
                          f"{ngram_heads(cfg)} n-gram heads")
    _check_stored_hash(cfg, len(layers))
    if not 0 <= q.ngram_eos_token < cfg.vocab_size:
        raise ConfigError(f"model config: ngram_eos_token={q.ngram_eos_token} is not a token id")


def _check_stored_hash(cfg: "ModelConfig", n_ple: int) -> None:
    """The stored hash constants (where there are any): a list per PLE layer, ngram_size multipliers
    in [0, 2^63 / vocab] (token x multiplier must not pass 2^63: the hash is int64 here, uint64 in
    llama.cpp, and the two agree only below it, as they do for the derived ones), N positive head
    sizes and offsets inside the table."""
    q = cfg.qwen4
    given = [name for name in STORED_HASH_FIELDS if getattr(q, name).strip()]
    if not given:
        if q.ngram_table_rows:
            raise ConfigError("model config: ngram_table_rows is set without the stored hash constants "
                              f"({', '.join(STORED_HASH_FIELDS)})")
        return
    if len(given) != len(STORED_HASH_FIELDS):
        raise ConfigError(f"model config: {', '.join(STORED_HASH_FIELDS)} are stored together, got only "
                          f"{', '.join(given)}")
    try:
        lists = {name: _stored_lists(cfg, name) for name in STORED_HASH_FIELDS}
    except (ValueError, OverflowError):
        raise ConfigError(f"model config: {', '.join(STORED_HASH_FIELDS)} must be comma-separated integers, "
                          "one list per PLE layer joined by ';'")
    want = {"ngram_multipliers": q.ngram_size, "ngram_head_sizes": ngram_heads(cfg),
            "ngram_head_offsets": ngram_heads(cfg)}
    for name, groups in lists.items():
        if len(groups) != n_ple or any(len(g) != want[name] for g in groups):
            raise ConfigError(f"model config: {name} must hold {n_ple} list(s) (one per PLE layer) of "
                              f"{want[name]} values, got {[len(g) for g in groups]}")
    bound = ((1 << 63) - 1) // max(cfg.vocab_size, 1)
    for m in lists["ngram_multipliers"]:
        if np.any(m < 0) or np.any(m > bound):
            raise ConfigError(f"model config: ngram_multipliers {m.tolist()} must be in [0, {bound}] "
                              "(2^63 / vocab_size: a token times one must stay below 2^63)")
    for layer, (sizes, offsets) in enumerate(zip(lists["ngram_head_sizes"], lists["ngram_head_offsets"])):
        rows = padded_rows(cfg, int((sizes + offsets).max()))
        if np.any(sizes <= 0) or np.any(offsets < 0) or int((sizes + offsets).max()) > rows:
            raise ConfigError(f"model config: PLE layer {layer}'s ngram_head_sizes {sizes.tolist()} / "
                              f"ngram_head_offsets {offsets.tolist()} must be positive and fit its {rows} rows")


MADE_SHAPES = {
    # 4 hyper-connection streams, three DeltaNet layers (PLE modules on two), then indexed attention
    # whose budget (2 blocks of 4) is smaller than most contexts, so selection matters
    "qwen4": dict(hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=16,
                  n_experts_per_token=4, expert_ffn_size=32, shared_ffn_size=32, shared_expert_gated=True,
                  qk_norm=QKNorm.PER_HEAD, max_context=256,
                  layer_types=((LayerType(Mixer.DELTANET, Ffn.MOE),) * 3
                               + (LayerType(Mixer.INDEXED_ATTENTION, Ffn.MOE),)),
                  rotary_dim=8, attention_output_gate=True, deltanet=MADE_DELTANET,
                  qwen4=Qwen4Config(hc_count=4, hc_lowrank=16, indexer_heads=2, indexer_head_dim=16,
                                    indexer_budget=8, indexer_block=4, ple_layer_ids="0,2", ple_embed_dim=32,
                                    ple_conv_kernel=4, ngram_size=3, ngram_heads_per_order=2, ngram_vocab_base=101,
                                    ngram_vocab_divisor=8, ngram_seed=1234, ngram_eos_token=MADE_VOCAB - 1)),
}

FAMILY = FamilyParts(
    name="Qwen4-Exp", model_types=("qwen4_exp_text", "qwen4_exp"), converter="strata.convert.qwen4_exp",
    check=check_qwen4_fields, made_shapes=MADE_SHAPES,
)
