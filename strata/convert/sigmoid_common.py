"""What the sigmoid-routed families (DeepSeek-V3 / Kimi-K2, GLM-4.5 / 4.7, MiniMax-M2) read
alike: the routing fields, the dense-first layers, partial rotary, and their MTP layers.

- Routing: sigmoid scores, a selection-only bias (`e_score_correction_bias`), optional expert
  groups (`n_group`, `topk_group`), `norm_topk_prob`, `routed_scaling_factor`
  (RoutingOrder.SIGMOID_TOPK, docs/routing.md). A config naming another scoring function or
  top-k method (DeepSeek-V2's softmax / "greedy" / "group_limited_greedy") is refused.
- Tensors (`sigmoid_tensor_plan`, a `convert.tensor_plan.TensorPlan`): the Llama names of
  `dense_sources` plus the family's own per-layer names (MLA, the selection bias, the shared
  experts, dense FFN layers); a family's rewrite of a tensor (DeepSeek's rope de-interleave) is a
  `Derived` tensor. Multi-token-prediction layers (`num_nextn_predict_layers`: DeepSeek-V3's and
  GLM-4.5's layer 61 / 92 ...) are a speculative-decoding head beside the model; transformers
  does not load them. A family whose config keeps one (DeepSeek-V3 / Kimi-K2 / GLM-4.7-Flash,
  GLM-4.5: `nextn_layers` = 1) gets its tensors as dense tensors (`nextn_sources`; names in
  strata/families/deepseek.py), computed by strata/reference/nextn.py; MiniMax-M2's, and what a
  kept layer does not use (its copy of the embedding), are skipped, with a note.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from strata.convert.common import LAYER, ExpertTensors, base_fields, dense_sources
from strata.convert.gguf_checkpoint import GgufCheckpoint, GgufExpertTensors
from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.convert.tensor_plan import Derived, TensorPlan
from strata.families.deepseek import NEXTN_NAMES, NEXTN_PREFIX, nextn_expert_name
from strata.model_config import Ffn, LayerType, Mixer, ModelConfig, RoutingOrder, dense_tensor_shapes

SIGMOID_SCORING = "sigmoid"
NOAUX_TOPK = "noaux_tc"  # DeepSeek-V3's name for "bias chooses, groups limit, no auxiliary loss"
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def sigmoid_base_fields(hf: HFConfig, ckpt: Checkpoint) -> dict:
    """`base_fields` for configs that call the expert count `n_routed_experts`."""
    raw = dict(hf.raw)
    if "n_routed_experts" in raw and raw.get("num_local_experts") is None and raw.get("num_experts") is None:
        raw["num_local_experts"] = raw["n_routed_experts"]
    return base_fields(dataclasses.replace(hf, raw=raw), ckpt)


def routing_fields(hf: HFConfig, *, groups: bool = True, scaling: bool = True, norm_default: bool = True) -> dict:
    """The sigmoid rule's ModelConfig fields (every MoE layer has a selection bias)."""
    scoring = hf.get("scoring_func", default=SIGMOID_SCORING)
    if scoring != SIGMOID_SCORING:
        raise hf.unsupported(f"scoring_func = {scoring!r}", "sigmoid scores")
    method = hf.get("topk_method", default=NOAUX_TOPK)
    if method != NOAUX_TOPK:
        raise hf.unsupported(f"topk_method = {method!r}", f"{NOAUX_TOPK!r} (bias-chosen, group-limited top-k)")
    return dict(
        routing_order=RoutingOrder.SIGMOID_TOPK, router_bias=True,
        n_group=hf.get_int("n_group", default=1) if groups else 1,
        topk_group=hf.get_int("topk_group", default=1) if groups else 1,
        norm_topk_prob=hf.get_bool("norm_topk_prob", default=norm_default),
        routed_scaling_factor=hf.get_float("routed_scaling_factor", default=1.0) if scaling else 1.0,
    )


def layer_kinds(hf: HFConfig, mixer: Mixer) -> tuple[LayerType, ...]:
    """Dense FFN for the first `first_k_dense_replace` layers (or where `mlp_layer_types` says
    "dense"), MoE after."""
    n = hf.get_int("num_hidden_layers")
    types = hf.get("mlp_layer_types", default=None)
    if types is None:
        k = hf.get_int("first_k_dense_replace", default=0)
        types = ["dense"] * k + ["sparse"] * (n - k)
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise hf.unsupported(f"mlp_layer_types = {types}", f"{n} entries, each 'dense' or 'sparse'")
    return tuple(LayerType(mixer, Ffn.DENSE if t == "dense" else Ffn.MOE) for t in types)


def rope_fields(hf: HFConfig, head_dim: int, default_theta: float) -> dict:
    """rope_theta and rotary_dim (partial rotary: `partial_rotary_factor` in rope_parameters or
    at the top level, or MiniMax's legacy `rotary_dim`); plain RoPE otherwise, as `rope_theta`."""
    params = hf.raw.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default=None))
    rotary = hf.get("rotary_dim", default=None)
    if factor is not None:
        rotary = int(head_dim * factor)
    raw = {k: v for k, v in hf.raw.items() if k not in ("partial_rotary_factor", "rotary_dim")}
    if isinstance(raw.get("rope_parameters"), dict):
        raw["rope_parameters"] = {k: v for k, v in raw["rope_parameters"].items() if k != "partial_rotary_factor"}
    theta = dataclasses.replace(hf, raw=raw).rope_theta(default_theta)
    return dict(rope_theta=theta, rotary_dim=0 if rotary in (None, head_dim) else int(rotary))


def mtp_layer(n_layers: int, name: str) -> bool:
    """Whether a checkpoint tensor belongs to a multi-token-prediction layer."""
    m = _LAYER_INDEX.match(name)
    return m is not None and int(m.group(1)) >= n_layers


def nextn_layers(hf: HFConfig, ckpt: Checkpoint, n_layers: int) -> int:
    """1 where the checkpoint carries a nextn layer (model.layers.{n_layers}.eh_proj), else 0;
    more than one, or one without routed experts, is refused by name."""
    layer = LAYER.format(n_layers)
    if isinstance(ckpt, GgufCheckpoint) or layer + "eh_proj.weight" not in ckpt:
        return 0
    if LAYER.format(n_layers + 1) + "eh_proj.weight" in ckpt:
        raise hf.unsupported("more than one nextn layer", "one nextn layer (num_nextn_predict_layers = 1)")
    if layer + "mlp.gate.weight" not in ckpt:
        raise hf.unsupported(f"a nextn layer without routed experts ({layer}mlp.gate.weight)", "an MoE nextn layer")
    return 1


# the nextn layer's own tensors: strata name (families/deepseek.py NEXTN_NAMES) -> checkpoint suffix
_NEXTN_OWN = {"eh_proj": "eh_proj.weight", "enorm": "enorm.weight", "hnorm": "hnorm.weight",
              "shared_head_norm": "shared_head.norm.weight", "shared_head_head": "shared_head.head.weight"}


def nextn_sources(cfg: ModelConfig, model_sources: dict[str, str], moe: str,
                  projections: tuple[str, str, str]) -> dict[str, str]:
    """The kept nextn layer's dense tensors from the checkpoint's `model.layers.{n_layers}.*`: its
    decoder layer's as the model's first MoE layer's are read (`model_sources`: that layer's
    names), renamed to `nextn.blk.0.*`; its routed experts one tensor each; its own five."""
    l, src = cfg.moe_layers[0], LAYER.format(cfg.n_layers)
    mine, theirs = f"blk.{l}.", LAYER.format(l)
    out = {NEXTN_PREFIX + "blk.0." + name[len(mine):]: src + ck[len(theirs):]
           for name, ck in model_sources.items() if name.startswith(mine)}
    out.update({NEXTN_NAMES[k]: src + v for k, v in _NEXTN_OWN.items()})
    for e in range(cfg.n_experts):
        for p, proj in zip(("gate", "up", "down"), projections):
            out[nextn_expert_name(p, e)] = f"{src}{moe}.experts.{e}.{proj}.weight"
    return out


# (cfg, strata dense name) -> the rewrite of its checkpoint tensor (float32 -> float32), or None
Rewrite = Callable[[ModelConfig, str], Callable[[np.ndarray], np.ndarray] | None]


def sigmoid_tensor_plan(layer_sources: tuple[tuple[str, str], ...], *, moe: str = "mlp",
                        projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                        rewrite: Rewrite | None = None, what: str = "") -> Callable[[ModelConfig, Checkpoint], TensorPlan]:
    """A `Family.tensor_plan`: `dense_sources` with `layer_sources` over its per-layer table
    ("{moe}": the MoE block), each tensor `rewrite` names derived, a kept nextn layer's tensors
    (`cfg.sigmoid.nextn_layers`) read, the other MTP tensors skipped."""

    def plan(cfg: ModelConfig, ckpt: Checkpoint) -> TensorPlan:
        sources: dict[str, str | Derived] = dict(dense_sources(cfg, moe, layer_sources))
        if cfg.sigmoid.nextn_layers:
            sources.update(nextn_sources(cfg, dict(sources), moe, projections))  # type: ignore[arg-type]
        if rewrite is not None:
            shapes = dense_tensor_shapes(cfg)
            for name, src in list(sources.items()):
                make = rewrite(cfg, name)
                if make is not None:
                    sources[name] = Derived(((src, shapes[name]),), make, what)
        read = {name for src in sources.values()
                for name in ((src,) if isinstance(src, str) else (inp for inp, _ in src.inputs))}
        skipped = tuple(t for t in ckpt.tensors if mtp_layer(cfg.n_layers, t) and t not in read)
        notes = ((f"kept the multi-token-prediction (nextn) layer {LAYER.format(cfg.n_layers)}* for MTP drafting",)
                 if cfg.sigmoid.nextn_layers else ())
        notes += (f"skipped {len(skipped)} multi-token-prediction tensors",) if skipped else ()
        if isinstance(ckpt, GgufCheckpoint):  # llama.cpp's stacked *_exps, kept as stored
            experts = GgufExpertTensors(ckpt, cfg)
        else:
            experts = ExpertTensors(ckpt, cfg, moe, projections)
        return TensorPlan(experts, sources, skipped, notes)

    return plan
