"""Qwen3-Next and Qwen3.5 / 3.6-MoE: gated DeltaNet (linear attention) layers between gated
full-attention layers with partial rotary, a gated shared expert in every layer.

Its converter: strata/convert/qwen_hybrid.py; its mixer: reference/deltanet.py (twins in
mlx_backend/deltanet.py); its fields: DeltaNetConfig (`ModelConfig.deltanet`), and the shared
attention_output_gate and rotary_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.errors import ConfigError
from strata.families.counts import PartCounts, common_sizes, config_value, gqa_attention_weights, published_counts
from strata.families.family import FamilyParts
from strata.layer_kinds import Ffn, LayerType, Mixer, QKNorm, MOE_LAYER

if TYPE_CHECKING:  # annotations only: model_config runs the check
    from strata.model_config import ModelConfig


@dataclass(frozen=True)
class DeltaNetConfig:
    """Gated DeltaNet's sizes (`ModelConfig.deltanet`; Mixer.DELTANET layers): Qwen3-Next,
    Qwen3.5 / 3.6-MoE and Qwen4-Exp. All 0 in a model without DeltaNet layers."""

    linear_k_heads: int = 0  # query/key heads
    linear_v_heads: int = 0  # value heads (a multiple of linear_k_heads)
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    linear_conv_kernel: int = 0  # width of the causal depthwise conv over the q/k/v channels
    mtp_layers: int = 0  # multi-token-prediction layers kept from the checkpoint (`mtp.*`; 0 or 1)


# The MTP layer's dense tensors in the model file (strata/reference/mtp.py: MtpWeights' fields);
# norms hold their applied scale (1 + w); experts one tensor per expert and projection.
MTP_NAMES = {
    "fc": "mtp.eh_proj.weight", "norm_embedding": "mtp.enorm.weight", "norm_hidden": "mtp.hnorm.weight",
    "norm": "mtp.shared_head_norm.weight", "input_norm": "mtp.attn_norm.weight",
    "post_attention_norm": "mtp.ffn_norm.weight", "q": "mtp.attn_q_gate.weight", "k": "mtp.attn_k.weight",
    "v": "mtp.attn_v.weight", "o": "mtp.attn_output.weight", "q_norm": "mtp.attn_q_norm.weight",
    "k_norm": "mtp.attn_k_norm.weight", "router": "mtp.ffn_gate_inp.weight", "shared_gate": "mtp.ffn_gate_shexp.weight",
    "shared_up": "mtp.ffn_up_shexp.weight", "shared_down": "mtp.ffn_down_shexp.weight",
    "shared_expert_gate": "mtp.ffn_gate_inp_shexp.weight",
}


def mtp_expert_name(projection: str, e: int) -> str:
    """Expert e's `projection` ("gate", "up", "down") of the MTP layer."""
    return f"mtp.ffn_{projection}.{e}.weight"


def mtp_tensor_shapes(cfg: "ModelConfig") -> dict[str, tuple[int, ...]]:
    """The MTP layer's dense tensors and shapes; none where the model keeps no MTP layer."""
    if not cfg.deltanet.mtp_layers:
        return {}
    d, hd, f, s = cfg.hidden_size, cfg.head_dim, cfg.expert_ffn_size, cfg.shared_ffn_size
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    by_field = {"fc": (d, 2 * d), "q": (2 * q, d), "k": (kv, d), "v": (kv, d), "o": (d, q), "q_norm": (hd,),
                "k_norm": (hd,), "router": (cfg.n_experts, d), "shared_gate": (s, d), "shared_up": (s, d),
                "shared_down": (d, s)}
    shapes = {name: by_field.get(field, (d,)) for field, name in MTP_NAMES.items()}
    for e in range(cfg.n_experts):
        shapes.update({mtp_expert_name("gate", e): (f, d), mtp_expert_name("up", e): (f, d),
                       mtp_expert_name("down", e): (d, f)})
    return shapes


def check_hybrid_fields(cfg: "ModelConfig") -> None:
    """The hybrid fields (Qwen3-Next, Qwen3.5): DeltaNet sizes where a layer needs them; at most
    one MTP layer, with the shared expert and gated attention its layer has."""
    if cfg.deltanet.mtp_layers not in (0, 1):
        raise ConfigError(f"model config: mtp_layers must be 0 or 1 (one MTP layer is kept), got {cfg.deltanet.mtp_layers}")
    if cfg.deltanet.mtp_layers and not (cfg.has_shared_expert and cfg.attention_output_gate):
        raise ConfigError("model config: an MTP layer needs the hybrids' gated attention and shared expert")
    if not any(t.mixer is Mixer.DELTANET for t in cfg.kinds):
        return
    dn = cfg.deltanet
    sizes = ("linear_k_heads", "linear_v_heads", "linear_k_head_dim", "linear_v_head_dim", "linear_conv_kernel")
    for name in sizes:
        if getattr(dn, name) <= 0:
            raise ConfigError(f"model config: DeltaNet layers need {name} > 0, got {getattr(dn, name)}")
    if dn.linear_v_heads % dn.linear_k_heads:
        raise ConfigError(f"model config: linear_v_heads={dn.linear_v_heads} is not a multiple of "
                          f"linear_k_heads={dn.linear_k_heads}")


def count_published(c: dict, t: str) -> PartCounts:
    """Its weights by part from a published config.json (strata doctor, where strata refuses it)."""
    hidden, vocab, L, tie = common_sizes(c)
    heads, kv_heads = int(config_value(c, "num_attention_heads")), int(config_value(c, "num_key_value_heads"))
    head_dim = int(c.get("head_dim") or hidden // heads)
    types = c.get("layer_types")
    if not types:
        every = int(c.get("full_attention_interval", 4))
        types = ["full_attention" if (l + 1) % every == 0 else "linear_attention" for l in range(L)]
    n_full = sum(1 for x in types if x == "full_attention")
    n_lin = L - n_full
    kh, vh = int(config_value(c, "linear_num_key_heads")), int(config_value(c, "linear_num_value_heads"))
    kd, vd = int(config_value(c, "linear_key_head_dim")), int(config_value(c, "linear_value_head_dim"))
    conv = int(c.get("linear_conv_kernel_dim", 4))
    k_dim, v_dim = kh * kd, vh * vd
    conv_dim = 2 * k_dim + v_dim
    # in_proj_qkvz [2K + 2V, D], in_proj_ba [2 Hv, D], conv1d [C, kernel], dt_bias + A_log [Hv], norm [Vd], out [D, V]
    deltanet = hidden * (2 * k_dim + 2 * v_dim) + hidden * 2 * vh + conv_dim * conv + 2 * vh + vd + v_dim * hidden
    full = gqa_attention_weights(hidden, heads, kv_heads, head_dim, out_gate=bool(c.get("attn_output_gate", True))) \
        + 2 * head_dim  # q/k norms
    moe_ffn, n_exp = int(config_value(c, "moe_intermediate_size")), int(config_value(c, "num_experts"))
    shared_ffn = int(c.get("shared_expert_intermediate_size") or 0)
    dense = {"attention": n_full * full + n_lin * deltanet,
             "shared_expert": L * (3 * hidden * shared_ffn + (hidden if shared_ffn else 0)),
             "router": L * n_exp * hidden, "norms": L * 2 * hidden + hidden}
    family = "Qwen3.5" if t.startswith("qwen3_5") else "Qwen3-Next"
    return published_counts(family, t, "gated DeltaNet + gated attention hybrid layers", hidden=hidden, vocab=vocab,
                            n_layers=L, moe_layers=L, n_experts=n_exp,
                            top_k=int(config_value(c, "num_experts_per_tok")),
                            expert_ffn=moe_ffn, expert_weights=3 * hidden * moe_ffn, dense=dense,
                            kv=2 * n_full * kv_heads * head_dim, tie=tie, linear_state=n_lin * vh * kd * vd)


# the made models' DeltaNet (Qwen4-Exp's made shape has the same)
MADE_DELTANET = DeltaNetConfig(linear_k_heads=2, linear_v_heads=4, linear_k_head_dim=16, linear_v_head_dim=16,
                               linear_conv_kernel=4)

MADE_SHAPES = {
    # three gated DeltaNet layers, then gated attention with partial rotary
    "hybrid": dict(hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=16,
                   n_experts_per_token=4, expert_ffn_size=32, shared_ffn_size=32, shared_expert_gated=True,
                   qk_norm=QKNorm.PER_HEAD, max_context=256,
                   layer_types=(LayerType(Mixer.DELTANET, Ffn.MOE),) * 3 + (MOE_LAYER,), rotary_dim=8,
                   attention_output_gate=True, deltanet=MADE_DELTANET),
}

FAMILY = FamilyParts(
    name="Qwen3-Next / Qwen3.5-MoE", model_types=("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"),
    converter="strata.convert.qwen_hybrid", check=check_hybrid_fields, made_shapes=MADE_SHAPES,
    count_published=count_published, published_types=("qwen3_5", "qwen3_next"),
)
