"""Small valid models for tests and demos: `make_model(path, shape, seed)` (CLI: `strata make-model`).

The weights are random, but the routing is shaped like a trained model's (see docs/testing.md):

- **Skew.** Every hidden state carries a shared direction `c` (the embeddings' common mean,
  which RMSNorm keeps), and each router row carries `popularity[e] * c` with Zipf-like
  popularity, so a few experts win often and most rarely.
- **Locality.** Attention is near-uniform over the context (small q/k), so its output is a
  running average that moves slowly from token to token; the value/output projections write
  into a low-rank "context" subspace, and the routers read mostly that subspace (low-rank
  routers). Consecutive tokens therefore share many of their experts, as real models do.
- Per-token noise (a small full-rank router term) keeps routing from being constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.formats.expert_record import ExpertWeights
from strata.formats.experts_file import ExpertsFile, write_experts
from strata.formats.model_file import write_model
from strata.families.family import MADE_VOCAB
from strata.families.registry import FAMILIES
from strata.formats.quant_matrix import QuantMatrix
from strata.formats.quant_types import QuantType, is_whole_blocks
from strata.model_config import (
    MOE_LAYER, Ffn, LayerType, Mixer, ModelConfig, QKNorm, TensorNames,
    dense_tensor_shapes,
)
from strata.testing.ggml_random import random_block_matrix
from strata.testing.gpt_oss import expert_biases, gpt_oss_dense
from strata.reference.quants import quantize
from strata.testing.hybrid import deltanet_dense
from strata.tokenizer import byte_level_tokenizer_json

BYTE_VOCAB = MADE_VOCAB  # 256 bytes + <|endoftext|>

SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        architecture="strata_test", vocab_size=BYTE_VOCAB, hidden_size=64, n_layers=2, n_heads=4,
        n_kv_heads=2, head_dim=16, n_experts=16, n_experts_per_token=4, expert_ffn_size=32,
        shared_ffn_size=32, shared_expert_gated=True, qk_norm=QKNorm.PER_HEAD, max_context=256,
    ),
    "small": ModelConfig(
        architecture="strata_test", vocab_size=BYTE_VOCAB, hidden_size=128, n_layers=4, n_heads=4,
        n_kv_heads=2, head_dim=32, n_experts=32, n_experts_per_token=4, expert_ffn_size=64,
        shared_ffn_size=64, shared_expert_gated=True, qk_norm=QKNorm.PER_HEAD, max_context=1024,
    ),
    # DeepSeek-style: a dense first layer, MoE layers after it (no cache turn for the dense one)
    "dense-first": ModelConfig(
        architecture="strata_test", vocab_size=BYTE_VOCAB, hidden_size=64, n_layers=3, n_heads=4,
        n_kv_heads=2, head_dim=16, n_experts=16, n_experts_per_token=4, expert_ffn_size=32,
        shared_ffn_size=32, shared_expert_gated=True, qk_norm=QKNorm.PER_HEAD, max_context=256,
        layer_types=(LayerType(Mixer.ATTENTION, Ffn.DENSE), MOE_LAYER, MOE_LAYER), dense_ffn_size=96,
    ),
    # each family's own made shapes (strata/families/<family>.py MADE_SHAPES), in the registry's order
    **{name: ModelConfig(architecture="strata_test", vocab_size=BYTE_VOCAB, **fields)
       for family in FAMILIES for name, fields in family.made_shapes.items()},
    "demo": ModelConfig(
        architecture="strata_test", vocab_size=BYTE_VOCAB, hidden_size=256, n_layers=8, n_heads=8,
        n_kv_heads=2, head_dim=32, n_experts=64, n_experts_per_token=4, expert_ffn_size=128,
        shared_ffn_size=256, shared_expert_gated=True, qk_norm=QKNorm.PER_HEAD, max_context=2048,
    ),
}

CONTEXT_RANK = 8  # dimension of the slowly-varying subspace the routers read
ZIPF_EXPONENT = 1.1  # expert popularity ~ 1 / rank^s
POPULARITY_SCALE = 2.0  # logit spread the popularity term gives across experts
ROUTER_NOISE = 2.0  # weight of the full-rank, per-token router term
QK_SCALE = 0.02  # small q/k: near-uniform attention, a slowly moving context average
COMMON_SCALE = 0.3  # size of the shared direction in every embedding, relative to the per-token part
CONTEXT_ROUTER_SCALE = 2.0  # weight of the low-rank (context) router term
ATTN_OUT_SCALE = 0.5  # how strongly attention writes the context average into the residual
# selection-bias spread of sigmoid routers: near the gaps between the top sigmoid scores, so the
# bias changes some selections (as DeepSeek-V3's load-balancing biases do) without deciding all
SELECTION_BIAS_SCALE = 0.05


@dataclass(frozen=True)
class MadeModel:
    model_path: Path
    experts_path: Path
    cfg: ModelConfig


def model_paths(path: str | Path) -> tuple[Path, Path]:
    """`x` or `x.gguf` -> (x.gguf, x.experts)."""
    p = Path(path)
    if p.suffix != ".gguf":
        p = p.with_name(p.name + ".gguf")
    return p, p.with_suffix(".experts")


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def make_dense(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Dense weights with the routing structure described in the module docstring."""
    rng = np.random.default_rng([seed, 0])
    d = cfg.hidden_size
    n = TensorNames
    common = _normal(rng, (d,), 1.0)  # the shared direction c
    common /= np.linalg.norm(common)
    basis = np.linalg.qr(rng.standard_normal((d, CONTEXT_RANK)))[0].T.astype(np.float32)  # [r, D]
    dense: dict[str, np.ndarray] = {}
    for name, shape in dense_tensor_shapes(cfg).items():
        if len(shape) == 1:
            dense[name] = np.ones(shape, np.float32)  # norms; biases are overwritten below
        else:
            dense[name] = _normal(rng, shape, 1.0 / np.sqrt(shape[1]))
    embd = _normal(rng, (cfg.vocab_size, d), 1.0) + COMMON_SCALE * np.sqrt(d) * common
    dense[n.token_embd] = (embd / np.sqrt(d)).astype(np.float32)
    ranks = np.arange(1, cfg.n_experts + 1, dtype=np.float64)
    for layer, kind in enumerate(cfg.kinds):
        b = lambda s: n.block(layer, s)  # noqa: E731
        if kind.mixer is Mixer.DELTANET:
            dense.update(deltanet_dense(cfg, layer, rng, basis, ATTN_OUT_SCALE))
        else:
            if kind.mixer is Mixer.MLA:  # small queries: near-uniform attention, as small q/k below
                dense[b(n.attn_q_b if cfg.mla.q_lora_rank else n.attn_q)] *= QK_SCALE
            else:
                dense[b(n.attn_q)] *= QK_SCALE
                dense[b(n.attn_k)] *= QK_SCALE
            # values/output: write the context average into the low-rank subspace the routers read
            dense[b(n.attn_output)] = (basis.T @ _normal(rng, (CONTEXT_RANK, dense[b(n.attn_output)].shape[1]), 1.0)
                                       * ATTN_OUT_SCALE / np.sqrt(CONTEXT_RANK)).astype(np.float32)
        if cfg.attention_bias:
            for bias in (n.attn_q_bias, n.attn_k_bias, n.attn_v_bias):
                dense[b(bias)] = _normal(rng, dense[b(bias)].shape, 0.02)
        if kind.ffn is Ffn.DENSE:
            continue
        popularity = np.log(1.0 / ranks ** ZIPF_EXPONENT)
        popularity = rng.permutation((popularity - popularity.mean()) / popularity.std() * POPULARITY_SCALE)
        low_rank = _normal(rng, (cfg.n_experts, CONTEXT_RANK), CONTEXT_ROUTER_SCALE) @ basis  # [E, D]
        noise = _normal(rng, (cfg.n_experts, d), ROUTER_NOISE)
        dense[b(n.router)] = (popularity[:, None] * common[None, :] + low_rank + noise).astype(np.float32)
        if cfg.has_shared_expert and cfg.shared_expert_gated:
            dense[b(n.shexp_gate_inp)] = _normal(rng, (d,), 1.0 / np.sqrt(d))
        if cfg.sigmoid.router_bias:
            dense[b(n.exp_probs_b)] = _normal(rng, (cfg.n_experts,), SELECTION_BIAS_SCALE)
    for layer in range(cfg.n_layers):
        dense.update(gpt_oss_dense(cfg, layer, rng))
    return dense


def make_expert(cfg: ModelConfig, seed: int, layer: int, expert: int, qtype: QuantType) -> ExpertWeights:
    """One routed expert, random, drawn from its own seeded stream (so writing can stream).
    llama.cpp's block types (Q4_K, IQ4_NL, ...: strata keeps them, never makes them) are random
    blocks at the same scale (strata.testing.ggml_random)."""
    rng = np.random.default_rng([seed, 1, layer, expert])
    d, f = cfg.hidden_size, cfg.expert_ffn_size

    def matrix(rows: int, cols: int) -> QuantMatrix:
        if is_whole_blocks(qtype):
            return random_block_matrix(qtype, rows, cols, rng, rms=1.0 / np.sqrt(cols))
        return quantize(qtype, _normal(rng, (rows, cols), 1.0 / np.sqrt(cols)))

    return ExpertWeights(
        gate=matrix(f, d),
        up=matrix(f, d),
        down=matrix(d, f),
        biases=expert_biases(cfg, rng),
    )


def make_model(
    path: str | Path,
    shape: str | ModelConfig = "tiny",
    seed: int = 0,
    *,
    expert_type: QuantType = QuantType.Q2_0,
    dense_type: QuantType = QuantType.F32,
    progress: bool = False,
    ple_rows: QuantType | None = None,
    **overrides,
) -> MadeModel:
    """Write `<path>.gguf` and `<path>.experts`: a small valid model with structured routing.

    `shape` names a preset in SHAPES (or is a ModelConfig); keyword `overrides` replace config
    fields (for example `n_layers=3`). `ple_rows` (a PLE shape, `qwen4`): write the n-gram tables
    into the row store `<path>.ngrams` in that row type, as `strata convert` does, instead of the
    model file; the other tensors are those of the same seed without it.
    """
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join(SHAPES)}")
        cfg = SHAPES[shape]
    else:
        cfg = shape
    cfg = cfg.with_fields(**overrides) if overrides else cfg
    model_path, experts_path = model_paths(path)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    write_experts(
        experts_path, qtype=expert_type, n_layers=cfg.n_moe_layers, n_experts=cfg.n_experts,
        hidden=cfg.hidden_size, expert_ffn=cfg.expert_ffn_size,
        get_expert=lambda l, e: make_expert(cfg, seed, l, e, expert_type), progress=progress,
        biases=cfg.gpt_oss.expert_bias,
    )
    with ExpertsFile.open(experts_path) as xf:  # the model records which expert set it goes with
        identity = xf.identity
    dense = make_dense(cfg, seed)
    if dense_type in (QuantType.F16, QuantType.Q8_0):  # 1-D tensors are stored F32, but MLX's kernel path holds them as
        # float16 (the shared expert's gate: 2.4e-4 relative on the hybrid's logits): make them exact
        dense = {k: v.astype(np.float16).astype(np.float32) if v.ndim == 1 else v for k, v in dense.items()}
    ngrams = None
    if ple_rows is not None:  # the tables out of the model file, into its row store
        from strata.testing.ngram_rows import move_tables_to_store

        cfg, dense, ngrams = move_tables_to_store(cfg, dense, model_path.with_suffix(".ngrams"), ple_rows)
    write_model(model_path, cfg, dense, tokenizer_json=byte_level_tokenizer_json(),
                dense_type=dense_type, experts_identity=identity, ngrams_identity=ngrams)
    return MadeModel(model_path, experts_path, cfg)
