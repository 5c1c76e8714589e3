"""Dense tensor names (llama.cpp's GGUF spelling) and each mixer's tensors with their shapes
(`MIXER_TENSORS`, keyed by the mixer kind).

`model_config.dense_tensor_shapes` composes the whole model's list from these; a family with
tensors of its own (strata/families/) composes it from them too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from strata.layer_kinds import Mixer, QKNorm

if TYPE_CHECKING:  # annotations only: a config is read, never built, here
    from strata.model_config import ModelConfig


# Tensors only a drafter reads (a checkpoint's MTP / nextn layer: `mtp.*` for the Qwen hybrids,
# `nextn.*` for DeepSeek-V3 / GLM-4.5): kept in the model file, but not loaded with the model,
# since they would be resident dense bytes (DeepSeek-V3's nextn layer holds ~11 B expert
# weights) that a run without drafting never reads; strata.speculative.mtp loads them itself.
DRAFTER_ONLY_PREFIXES = ("mtp.", "nextn.")


def drafter_only(name: str) -> bool:
    return name.startswith(DRAFTER_ONLY_PREFIXES)


class TensorNames:
    """Dense tensor names (llama.cpp's GGUF spelling); numpy shapes are [out, in]."""

    token_embd = "token_embd.weight"  # [vocab, hidden]
    output_norm = "output_norm.weight"  # [hidden]
    output = "output.weight"  # [vocab, hidden]; absent when embeddings are tied

    @staticmethod
    def block(layer: int, name: str) -> str:
        return f"blk.{layer}.{name}"

    # per-layer suffixes, used with block()
    attn_norm = "attn_norm.weight"  # [hidden]
    attn_q = "attn_q.weight"  # [n_heads * head_dim, hidden]
    attn_k = "attn_k.weight"  # [n_kv_heads * head_dim, hidden]
    attn_v = "attn_v.weight"  # [n_kv_heads * head_dim, hidden]
    attn_q_bias = "attn_q.bias"
    attn_k_bias = "attn_k.bias"
    attn_v_bias = "attn_v.bias"
    attn_output = "attn_output.weight"  # [hidden, n_heads * head_dim]
    attn_q_norm = "attn_q_norm.weight"  # [head_dim] (PER_HEAD) or [n_heads * head_dim] (FULL)
    attn_k_norm = "attn_k_norm.weight"  # [head_dim] or [n_kv_heads * head_dim]
    ffn_norm = "ffn_norm.weight"  # [hidden]
    router = "ffn_gate_inp.weight"  # [n_experts, hidden], F32
    router_logit_bias = "ffn_gate_inp.bias"  # [n_experts] (gpt-oss)
    attn_sinks = "attn_sinks.weight"  # [n_heads]: each head's sink logit (gpt-oss)
    attn_output_bias = "attn_output.bias"  # [hidden] (gpt-oss)
    shexp_gate = "ffn_gate_shexp.weight"  # [shared_ffn, hidden]
    shexp_up = "ffn_up_shexp.weight"  # [shared_ffn, hidden]
    shexp_down = "ffn_down_shexp.weight"  # [hidden, shared_ffn]
    shexp_gate_inp = "ffn_gate_inp_shexp.weight"  # [hidden]: the shared expert's sigmoid gate
    ffn_gate = "ffn_gate.weight"  # dense FFN layers: [dense_ffn, hidden]
    ffn_up = "ffn_up.weight"  # [dense_ffn, hidden]
    ffn_down = "ffn_down.weight"  # [hidden, dense_ffn]
    # hybrid models. C = 2 * linear_k_heads * linear_k_head_dim + V, V = linear_v_heads * linear_v_head_dim
    attn_gate = "attn_gate.weight"  # [n_heads * head_dim, hidden]: the attention output gate
    ssm_qkv = "ssm_qkv.weight"  # [C, hidden]: DeltaNet q (all k heads), k, v (all v heads)
    ssm_z = "ssm_z.weight"  # [V, hidden]: the gate of the gated RMSNorm
    ssm_beta = "ssm_beta.weight"  # [linear_v_heads, hidden]: beta = sigmoid(x · w)
    ssm_alpha = "ssm_alpha.weight"  # [linear_v_heads, hidden]: the decay step's input
    ssm_conv = "ssm_conv1d.weight"  # [C, linear_conv_kernel]: causal depthwise conv
    ssm_a = "ssm_a"  # [linear_v_heads]: -exp(A_log), the decay rate (log decay = a * softplus(...))
    ssm_dt_bias = "ssm_dt.bias"  # [linear_v_heads]
    ssm_norm = "ssm_norm.weight"  # [linear_v_head_dim]: the gated RMSNorm, shared by every head
    ssm_out = "ssm_out.weight"  # [hidden, V]
    # sigmoid routing: the selection-only bias of an MoE layer's router
    exp_probs_b = "exp_probs_b.bias"  # [n_experts], F32
    # latent attention (Mixer.MLA); r = qk_rope_head_dim, n = qk_nope_head_dim, v = v_head_dim
    attn_q_a = "attn_q_a.weight"  # [q_lora_rank, hidden]
    attn_q_a_norm = "attn_q_a_norm.weight"  # [q_lora_rank]
    attn_q_b = "attn_q_b.weight"  # [n_heads * (n + r), q_lora_rank]  (attn_q when q_lora_rank = 0)
    attn_kv_a_mqa = "attn_kv_a_mqa.weight"  # [kv_lora_rank + r, hidden]: the latent and the shared rope key
    attn_kv_a_norm = "attn_kv_a_norm.weight"  # [kv_lora_rank]
    attn_kv_b = "attn_kv_b.weight"  # [n_heads * (n + v), kv_lora_rank]: per head, its nope key rows then value rows



def attention_tensor_shapes(cfg: ModelConfig, l: int) -> dict[str, tuple[int, ...]]:
    """An attention layer's mixer tensors (the norm before it is the layer's attn_norm)."""
    n = TensorNames
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    b = lambda s: n.block(l, s)  # noqa: E731
    shapes: dict[str, tuple[int, ...]] = {}
    shapes[b(n.attn_q)] = (q_dim, cfg.hidden_size)
    shapes[b(n.attn_k)] = (kv_dim, cfg.hidden_size)
    shapes[b(n.attn_v)] = (kv_dim, cfg.hidden_size)
    shapes[b(n.attn_output)] = (cfg.hidden_size, q_dim)
    if cfg.attention_bias:
        shapes[b(n.attn_q_bias)] = (q_dim,)
        shapes[b(n.attn_k_bias)] = (kv_dim,)
        shapes[b(n.attn_v_bias)] = (kv_dim,)
    if cfg.qk_norm is QKNorm.PER_HEAD:
        shapes[b(n.attn_q_norm)] = (cfg.head_dim,)
        shapes[b(n.attn_k_norm)] = (cfg.head_dim,)
    elif cfg.qk_norm is QKNorm.FULL:
        shapes[b(n.attn_q_norm)] = (q_dim,)
        shapes[b(n.attn_k_norm)] = (kv_dim,)
    if cfg.attention_output_gate:
        shapes[b(n.attn_gate)] = (q_dim, cfg.hidden_size)
    if cfg.gpt_oss.attention_sinks:
        shapes[b(n.attn_sinks)] = (cfg.n_heads,)
    if cfg.gpt_oss.attention_output_bias:
        shapes[b(n.attn_output_bias)] = (cfg.hidden_size,)
    return shapes


def deltanet_tensor_shapes(cfg: ModelConfig, l: int) -> dict[str, tuple[int, ...]]:
    """A gated DeltaNet layer's mixer tensors."""
    n = TensorNames
    hv, d = cfg.deltanet.linear_v_heads, cfg.hidden_size
    v_dim = hv * cfg.deltanet.linear_v_head_dim
    conv_dim = 2 * cfg.deltanet.linear_k_heads * cfg.deltanet.linear_k_head_dim + v_dim
    b = lambda s: n.block(l, s)  # noqa: E731
    return {b(n.ssm_qkv): (conv_dim, d), b(n.ssm_z): (v_dim, d), b(n.ssm_beta): (hv, d), b(n.ssm_alpha): (hv, d),
            b(n.ssm_conv): (conv_dim, cfg.deltanet.linear_conv_kernel), b(n.ssm_a): (hv,), b(n.ssm_dt_bias): (hv,),
            b(n.ssm_norm): (cfg.deltanet.linear_v_head_dim,), b(n.ssm_out): (d, v_dim)}


def mla_tensor_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """A latent-attention layer's projections (reference/mla.py), with their shapes."""
    n, b = TensorNames, (lambda s: TensorNames.block(layer, s))  # noqa: E731
    h, d = cfg.n_heads, cfg.hidden_size
    qk = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
    shapes = {b(n.attn_kv_a_mqa): (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim, d),
              b(n.attn_kv_a_norm): (cfg.mla.kv_lora_rank,),
              b(n.attn_kv_b): (h * (cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim), cfg.mla.kv_lora_rank),
              b(n.attn_output): (d, h * cfg.mla.v_head_dim)}
    if cfg.mla.q_lora_rank:
        shapes.update({b(n.attn_q_a): (cfg.mla.q_lora_rank, d), b(n.attn_q_a_norm): (cfg.mla.q_lora_rank,),
                       b(n.attn_q_b): (h * qk, cfg.mla.q_lora_rank)})
    else:
        shapes[b(n.attn_q)] = (h * qk, d)
    return shapes


# each mixer kind's own tensors (the norm before it is the layer's attn_norm): one entry per kind.
# Indexed attention is attention's projections; its indexer's tensors are its family's
# (families/qwen4_exp.py), as is every tensor of a hyper-connection model.
MIXER_TENSORS: dict[Mixer, Callable[["ModelConfig", int], dict[str, tuple[int, ...]]]] = {
    Mixer.ATTENTION: attention_tensor_shapes,
    Mixer.SLIDING_ATTENTION: attention_tensor_shapes,
    Mixer.DELTANET: deltanet_tensor_shapes,
    Mixer.MLA: mla_tensor_shapes,
    Mixer.INDEXED_ATTENTION: attention_tensor_shapes,
}
