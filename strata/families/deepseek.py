"""DeepSeek-V3 / Kimi-K2 and GLM-4.7-Flash: multi-head latent attention, sigmoid routing with a
selection-only bias and expert groups, scaled combine weights, dense first layers. GLM-4.5 and
MiniMax-M2 share the routing rules checked here (their converters: convert/glm_moe.py, minimax.py).

Its converter: strata/convert/deepseek.py; its mixer: reference/mla.py (twins in mlx_backend/mla.py);
its routing: reference/routing.py (SIGMOID_TOPK).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.errors import ConfigError
from strata.families.counts import PartCounts, common_sizes, config_value, published_counts
from strata.families.family import FamilyParts
from strata.layer_kinds import Ffn, LayerType, Mixer, QKNorm, RoutingOrder, MOE_LAYER

if TYPE_CHECKING:  # annotations only: model_config runs the check
    from strata.model_config import ModelConfig


@dataclass(frozen=True)
class SigmoidRoutingConfig:
    """Sigmoid routing's fields (`ModelConfig.sigmoid`; RoutingOrder.SIGMOID_TOPK): DeepSeek-V3 /
    Kimi-K2, GLM-4.5, GLM-4.7-Flash and MiniMax-M2 route this way."""

    n_group: int = 1  # experts form n_group equal groups; only the best topk_group groups are eligible
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed combine weights are multiplied by it
    router_bias: bool = False  # each MoE layer has a selection-only bias (exp_probs_b): chooses, never weights
    nextn_layers: int = 0  # multi-token-prediction ("nextn") layers kept from the checkpoint (0 or 1)


@dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention's sizes (`ModelConfig.mla`; Mixer.MLA): the model's head_dim is
    the q/k head (nope + rope), and n_kv_heads = n_heads."""

    q_lora_rank: int = 0  # 0: queries projected directly (no low-rank q path)
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0


# DeepSeek-V3's / GLM-4.5's kept multi-token-prediction ("nextn") layer in the model file: its own
# tensors (llama.cpp's names), and one decoder layer of the model's MoE layers' kind (MLA + MoE;
# attention + MoE for GLM-4.5) whose tensors are a model layer's names
# under `NEXTN_PREFIX` (`nextn.blk.0.*`: strip the prefix and the reference computes it as layer
# 0 of a one-layer model, strata/reference/nextn.py); its routed experts are dense tensors, one
# per expert and projection (the `.experts` file indexes records by the model's own MoE layers).
NEXTN_PREFIX = "nextn."
NEXTN_NAMES = {
    "eh_proj": "nextn.eh_proj.weight", "enorm": "nextn.enorm.weight", "hnorm": "nextn.hnorm.weight",
    "shared_head_norm": "nextn.shared_head_norm.weight", "shared_head_head": "nextn.shared_head_head.weight",
}


def nextn_expert_name(projection: str, e: int) -> str:
    """Expert e's `projection` ("gate", "up", "down") of the nextn layer."""
    return f"{NEXTN_PREFIX}ffn_{projection}.{e}.weight"


def nextn_tensor_shapes(cfg: "ModelConfig", layer_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The nextn layer's dense tensors and shapes, given layer 0's as an MoE layer of the model's
    kind (`layer_shapes`, `blk.0.*`); none where the model keeps no nextn layer."""
    if not cfg.sigmoid.nextn_layers:
        return {}
    d, f = cfg.hidden_size, cfg.expert_ffn_size
    shapes = {NEXTN_PREFIX + name: shape for name, shape in layer_shapes.items()}
    shapes.update({NEXTN_NAMES["eh_proj"]: (d, 2 * d), NEXTN_NAMES["enorm"]: (d,), NEXTN_NAMES["hnorm"]: (d,),
                   NEXTN_NAMES["shared_head_norm"]: (d,), NEXTN_NAMES["shared_head_head"]: (cfg.vocab_size, d)})
    for e in range(cfg.n_experts):
        shapes.update({nextn_expert_name("gate", e): (f, d), nextn_expert_name("up", e): (f, d),
                       nextn_expert_name("down", e): (d, f)})
    return shapes


def check_sigmoid_fields(cfg: "ModelConfig") -> None:
    """The sigmoid-routing and latent-attention fields' own rules (one ConfigError naming the field)."""
    r, mla = cfg.sigmoid, cfg.mla
    if r.n_group < 1 or cfg.n_experts % r.n_group:
        raise ConfigError(f"model config: n_group={r.n_group} must divide n_experts={cfg.n_experts}")
    if not 1 <= r.topk_group <= r.n_group:
        raise ConfigError(f"model config: topk_group={r.topk_group} must be in 1..n_group={r.n_group}")
    if r.n_group > 1 and cfg.n_experts // r.n_group < 2:
        raise ConfigError("model config: n_group needs >= 2 experts per group (groups score by their top 2)")
    if r.topk_group * (cfg.n_experts // r.n_group) < cfg.n_experts_per_token:
        raise ConfigError(f"model config: topk_group={r.topk_group} groups hold fewer than k experts")
    if cfg.routing_order is not RoutingOrder.SIGMOID_TOPK and (r.n_group > 1 or r.router_bias):
        raise ConfigError("model config: n_group / router_bias need routing_order sigmoid_topk")
    if any(t.mixer is Mixer.MLA for t in cfg.kinds):
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if getattr(mla, name) <= 0:
                raise ConfigError(f"model config: latent attention needs {name} > 0")
        if mla.qk_rope_head_dim % 2 or cfg.head_dim != mla.qk_nope_head_dim + mla.qk_rope_head_dim:
            raise ConfigError("model config: latent attention needs head_dim = qk_nope_head_dim + qk_rope_head_dim "
                              "(qk_rope_head_dim even)")
        if cfg.attention_bias or cfg.qk_norm is not QKNorm.NONE or cfg.rotary_dim or cfg.attention_output_gate:
            raise ConfigError("model config: latent attention takes no attention_bias, qk_norm, rotary_dim "
                              "or attention_output_gate")
    if r.nextn_layers not in (0, 1):
        raise ConfigError(f"model config: nextn_layers must be 0 or 1 (one nextn layer is kept), "
                          f"got {r.nextn_layers}")
    if r.nextn_layers and (not cfg.moe_layers or len({t.mixer for t in cfg.kinds}) != 1):
        raise ConfigError("model config: a nextn layer needs MoE layers and one mixer kind (its decoder layer's)")


def count_published(c: dict, t: str) -> PartCounts:
    """Its weights by part from a published config.json (strata doctor, where strata refuses it):
    MLA attention, `first_k_dense_replace` dense-MLP layers, `n_shared_experts` shared experts."""
    hidden, vocab, L, tie = common_sizes(c)
    heads = int(config_value(c, "num_attention_heads"))
    q_rank = c.get("q_lora_rank")
    kv_rank, nope, rope, v_dim = (int(config_value(c, k)) for k in ("kv_lora_rank", "qk_nope_head_dim",
                                                                     "qk_rope_head_dim",
                                                             "v_head_dim"))
    q_head = nope + rope
    q = hidden * heads * q_head if not q_rank else hidden * q_rank + q_rank + q_rank * heads * q_head
    attn = q + hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
    dense_layers = int(c.get("first_k_dense_replace", 0))
    freq = int(c.get("moe_layer_freq", 1))
    moe_layers = sum(1 for l in range(dense_layers, L) if l % freq == 0)
    ffn, moe_ffn = int(config_value(c, "intermediate_size")), int(config_value(c, "moe_intermediate_size"))
    n_exp, shared = int(config_value(c, "n_routed_experts")), int(c.get("n_shared_experts") or 0)
    dense = {"attention": L * attn, "dense_ffn": (L - moe_layers) * 3 * hidden * ffn,
             "shared_expert": moe_layers * shared * 3 * hidden * moe_ffn,
             "router": moe_layers * (n_exp * hidden + n_exp), "norms": L * 2 * hidden + hidden}
    return published_counts("DeepSeek-V3", t,
                            "MLA attention, sigmoid routing with expert groups and dense first layers",
                            hidden=hidden, vocab=vocab, n_layers=L, moe_layers=moe_layers, n_experts=n_exp,
                            top_k=int(config_value(c, "num_experts_per_tok")), expert_ffn=moe_ffn,
                            expert_weights=3 * hidden * moe_ffn,
                            dense=dense, kv=L * (kv_rank + rope), tie=tie)  # MLA caches the latent + the rope key


MADE_SHAPES = {
    # DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, a selection-only bias, 4 groups of which the
    # best 2 are eligible, scaled weights, an ungated shared expert, a dense first layer
    "sigmoid": dict(hidden_size=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=32,
                    n_experts_per_token=4, expert_ffn_size=32, shared_ffn_size=32, qk_norm=QKNorm.PER_HEAD,
                    max_context=256, routing_order=RoutingOrder.SIGMOID_TOPK,
                    layer_types=(LayerType(Mixer.ATTENTION, Ffn.DENSE), MOE_LAYER, MOE_LAYER), dense_ffn_size=96,
                    rotary_dim=8,
                    sigmoid=SigmoidRoutingConfig(n_group=4, topk_group=2, routed_scaling_factor=2.5, router_bias=True)),
    # DeepSeek-V3's layer kinds in small: latent attention (low-rank q, a latent + rope-key
    # cache), sigmoid routing with biases and groups, a shared expert, a dense first layer
    "mla": dict(hidden_size=64, n_layers=3, n_heads=4, n_kv_heads=4, head_dim=24, n_experts=32,
                n_experts_per_token=4, expert_ffn_size=32, shared_ffn_size=32, max_context=256,
                routing_order=RoutingOrder.SIGMOID_TOPK,
                layer_types=(LayerType(Mixer.MLA, Ffn.DENSE), LayerType(Mixer.MLA, Ffn.MOE),
                             LayerType(Mixer.MLA, Ffn.MOE)),
                dense_ffn_size=96,
                sigmoid=SigmoidRoutingConfig(n_group=4, topk_group=2, routed_scaling_factor=2.5, router_bias=True),
                mla=LatentAttentionConfig(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                          v_head_dim=16)),
}

FAMILY = FamilyParts(
    name="DeepSeek-V3 / GLM-4.7-Flash", model_types=("deepseek_v3", "kimi_k2", "glm4_moe_lite"),
    converter="strata.convert.deepseek", check=check_sigmoid_fields, made_shapes=MADE_SHAPES,
    count_published=count_published, published_types=("deepseek_v3", "deepseek_v2", "kimi_k2"),
)
