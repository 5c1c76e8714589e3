"""Qwen3-Next and Qwen3.5 / 3.6-MoE: hybrids of gated DeltaNet and gated attention layers.

Three `model_type`s: `qwen3_next`; `qwen3_5_moe_text` (the text-only class); `qwen3_5_moe` (the
multimodal class the published checkpoints use: the language model's config nested under
`text_config`, its weights under `model.language_model.`, a vision tower under `model.visual.`
that is skipped with a note: strata runs the language model on text).

What each config key becomes is listed below (`_TEXT_KEYS`): a key not listed is refused with a
one-line message naming it, so a feature strata does not compute never passes silently.
Tensors are mapped by `tensor_plan`, with these derivations (transformers' modeling files):
- the zero-centred RMSNorms (`x * (1 + w)`: layer norms, final norm, q/k norms) get the +1
  folded in; the DeltaNet's gated RMSNorm is a plain `x * w` and is copied;
- attention `q_proj` [H * 2 hd, D] is per head [query; gate] and is split into attn_q and
  attn_gate (the sigmoid output gate);
- Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` are grouped by key head ([q, k, v, z] and
  [b, a] per group of value heads) and are de-interleaved into the flat q | k | v, z, beta,
  alpha that Qwen3.5's separate projections already have;
- `A_log` becomes the decay rate a = -exp(A_log); `conv1d.weight` [C, 1, K] becomes [C, K].
The multi-token-prediction layer (`mtp.*`: fc, its norms, one gated-attention MoE decoder layer)
is kept as dense tensors (`mtp_layers` = 1; names in strata/families/qwen_hybrid.py, its
reference strata/reference/mtp.py): the MTP drafter (strata/speculative/mtp.py) runs it. Its
norms get the +1 folded in like the others; its q_proj stays [query; gate] per head; its
experts are kept one dense tensor each (not in the `.experts` file).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from strata.convert.common import ExpertTensors, Family, base_fields
from strata.convert.gguf_checkpoint import GgufCheckpoint, GgufExpertTensors
from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.convert.tensor_plan import Derived, TensorPlan
from strata.errors import ConfigError
from strata.families.qwen_hybrid import MTP_NAMES, mtp_expert_name
from strata.model_config import Ffn, LayerType, Mixer, ModelConfig, QKNorm, RoutingOrder, TensorNames

MULTIMODAL = "qwen3_5_moe"
PREFIX = {MULTIMODAL: "model.language_model."}  # else "model."
DEFAULT_PARTIAL_ROTARY = 0.25  # transformers' default for both configs
DEFAULT_FULL_ATTENTION_INTERVAL = 4
DEFAULT_ROPE_THETA = 10000.0
MTP_PREFIX = "mtp."
SKIPPED_PREFIXES = {"model.visual.": "the vision tower (model.visual.*): strata runs the language model on text"}

# every text-config key and how it is handled: read (used), check (only a value strata computes
# is accepted), or ignore (no effect on inference: training, generation defaults, bookkeeping)
_READ = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
         "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "layer_types", "full_attention_interval",
         "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
         "linear_num_value_heads", "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor",
         "norm_topk_prob", "attention_bias", "hidden_act", "model_type"}
_CHECK = {"decoder_sparse_step", "mlp_only_layers", "attn_output_gate", "use_sliding_window", "mamba_ssm_dtype",
          "quantization_config"}
_IGNORE = {"attention_dropout", "initializer_range", "output_router_logits", "router_aux_loss_coef", "use_cache",
           "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "transformers_version",
           "architectures", "intermediate_size",  # Qwen3-Next: the width of dense MLP layers (there are none)
           "sliding_window",  # read only with use_sliding_window (refused when true)
           "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "_name_or_path"}
_TEXT_KEYS = _READ | _CHECK | _IGNORE
# the multimodal wrapper's own keys: the text config, the vision tower (skipped), its token ids
_OUTER_KEYS = {"text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
               "vision_end_token_id", "tie_word_embeddings", "model_type", "architectures", "dtype", "torch_dtype",
               "transformers_version", "quantization_config", "_name_or_path"}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}


def _refuse_unknown(hf: HFConfig, keys: set[str], where: str) -> None:
    unknown = sorted(set(hf.raw) - keys)
    if unknown:
        raise hf.unsupported(f"config key {unknown[0]!r}{where}", "the keys docs/models.md lists for this family")


def nested_text_config(hf: HFConfig, multimodal: str) -> HFConfig:
    """The language model's config: `text_config` of the multimodal class (model_type
    `multimodal`, whose own keys must be `_OUTER_KEYS`), else the config itself."""
    if hf.model_type != multimodal:
        return hf
    _refuse_unknown(hf, _OUTER_KEYS, "")
    hf.check_not_quantized()
    text = hf.raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{hf.path}: a {multimodal} config needs a 'text_config' object")
    return dataclasses.replace(hf, raw=text)


def text_config(hf: HFConfig) -> HFConfig:
    """The language model's config: `text_config` of the multimodal class, else the config itself."""
    return nested_text_config(hf, MULTIMODAL)


def _rope(hf: HFConfig, head_dim: int) -> tuple[float, int]:
    """(rope_theta, rotary_dim) from `rope_parameters` (v5) or the v4 top-level keys.

    The multimodal rotary sections (`mrope_section`) give image and video tokens 3-D positions;
    a text token has the same position in all three, so for text they are plain RoPE."""
    params = hf.raw.get("rope_parameters")
    scaling = hf.raw.get("rope_scaling")
    for name, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        if d is None:
            continue
        if not isinstance(d, dict):
            raise ConfigError(f"{hf.path}: {name!r} must be an object, got {d!r}")
        kind = d.get("rope_type", d.get("type", "default"))
        if kind != "default":
            raise hf.unsupported(f"{name}.rope_type = {kind!r}", "plain RoPE (rope_type 'default')")
        extra = sorted(set(d) - _ROPE_KEYS)
        if extra:
            raise hf.unsupported(f"{name} key {extra[0]!r}", f"only {sorted(_ROPE_KEYS)}")
        section = d.get("mrope_section")
        if section is not None and not (isinstance(section, list) and all(isinstance(s, int) for s in section)):
            raise ConfigError(f"{hf.path}: {name}.mrope_section must be a list of integers, got {section!r}")
    params = params or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default=DEFAULT_PARTIAL_ROTARY))
    rotary = int(head_dim * factor)
    if rotary <= 0 or rotary % 2:
        raise hf.unsupported(f"partial_rotary_factor = {factor} (rotary dims {rotary} of head_dim {head_dim})",
                             "an even, positive number of rotary dims")
    theta = params.get("rope_theta", hf.get("rope_theta", default=DEFAULT_ROPE_THETA))
    return float(theta), rotary


def layer_types_of(hf: HFConfig, n_layers: int, kinds: dict[str, Mixer], every_nth: str) -> tuple[LayerType, ...]:
    """Every layer's (mixer, MoE) from `layer_types`, whose names `kinds` maps; a config without
    it has `every_nth` at every full_attention_interval-th layer and linear attention between."""
    names = hf.get("layer_types", default=None)
    if names is None:
        every = hf.get_int("full_attention_interval", default=DEFAULT_FULL_ATTENTION_INTERVAL)
        names = [every_nth if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(names, list) or len(names) != n_layers:
        raise ConfigError(f"{hf.path}: layer_types must list {n_layers} layer types, got {names!r}")
    bad = [t for t in names if t not in kinds]
    if bad:
        raise hf.unsupported(f"layer type {bad[0]!r}", f"{sorted(kinds)}")
    return tuple(LayerType(kinds[t], Ffn.MOE) for t in names)


def _layer_types(hf: HFConfig, n_layers: int) -> tuple[LayerType, ...]:
    kinds = {"linear_attention": Mixer.DELTANET, "full_attention": Mixer.ATTENTION}
    return layer_types_of(hf, n_layers, kinds, "full_attention")


def refuse_dense_layers(hf: HFConfig) -> None:
    """mlp_only_layers / decoder_sparse_step: strata converts these families with every layer MoE."""
    dense = hf.get("mlp_only_layers", default=[])
    step = hf.get_int("decoder_sparse_step", default=1)
    if dense or step != 1:
        raise hf.unsupported(f"dense MLP layers (mlp_only_layers={dense}, decoder_sparse_step={step})",
                             "every layer an MoE layer")


def refuse_attention_bias(hf: HFConfig) -> None:
    if hf.get_bool("attention_bias", default=False):
        raise hf.unsupported("attention_bias = true", "attention without biases")


def _check_values(hf: HFConfig) -> None:
    """The _CHECK keys: only what strata computes."""
    refuse_dense_layers(hf)
    if not hf.get_bool("attn_output_gate", default=True):
        raise hf.unsupported("attn_output_gate = false", "gated attention (attn_output_gate true)")
    if hf.get_bool("use_sliding_window", default=False):
        raise hf.unsupported("use_sliding_window = true", "full attention")
    ssm_dtype = hf.get("mamba_ssm_dtype", default="float32")
    if ssm_dtype != "float32":  # strata keeps the recurrent state in float32
        raise hf.unsupported(f"mamba_ssm_dtype = {ssm_dtype!r}", "'float32'")
    refuse_attention_bias(hf)


def gated_hybrid_fields(hf: HFConfig, text: HFConfig, base: dict, *, rope: tuple[float, int],
                        layer_types: tuple[LayerType, ...]) -> dict:
    """The ModelConfig fields the Qwen hybrids read alike, over `base` (base_fields of `text`):
    routed experts with a gated shared expert, softmax-then-top-k routing, per-head q/k norms,
    gated attention with (rope_theta, rotary_dim) = `rope`, the gated DeltaNet's sizes, and the
    multimodal wrapper's tie_word_embeddings (`hf` is that wrapper when `text` is not `hf`)."""
    theta, rotary = rope
    out = {}
    if text is not hf:
        out["tie_embeddings"] = hf.get_bool("tie_word_embeddings", default=base["tie_embeddings"])
    out.update(
        architecture=hf.model_type, expert_ffn_size=text.get_int("moe_intermediate_size"),
        shared_expert_gated=True, routing_order=RoutingOrder.SOFTMAX_TOPK,
        # Qwen3.5's router always renormalizes the top-k (it has no norm_topk_prob)
        norm_topk_prob=text.get_bool("norm_topk_prob", default=True),
        qk_norm=QKNorm.PER_HEAD, rope_theta=theta, max_context=text.max_context(None),
        layer_types=layer_types, rotary_dim=rotary, attention_output_gate=True,
        linear_k_heads=text.get_int("linear_num_key_heads"), linear_v_heads=text.get_int("linear_num_value_heads"),
        linear_k_head_dim=text.get_int("linear_key_head_dim"),
        linear_v_head_dim=text.get_int("linear_value_head_dim"),
        linear_conv_kernel=text.get_int("linear_conv_kernel_dim"),
    )
    return out


def hybrid_config(hf: HFConfig, ckpt: Checkpoint) -> ModelConfig:
    text = text_config(hf)
    _refuse_unknown(text, _TEXT_KEYS, " in text_config" if text is not hf else "")
    _check_values(text)
    fields = base_fields(text, ckpt)
    rope = _rope(text, fields["head_dim"])
    shared = text.get_int("shared_expert_intermediate_size")
    if shared <= 0:
        raise ConfigError(f"{hf.path}: shared_expert_intermediate_size must be positive, got {shared}")
    fields.update(gated_hybrid_fields(hf, text, fields, rope=rope, layer_types=_layer_types(text, fields["n_layers"])),
                  shared_ffn_size=shared, mtp_layers=_mtp_layers(hf, ckpt))
    return ModelConfig.from_dict(fields)


def _mtp_layers(hf: HFConfig, ckpt: Checkpoint) -> int:
    """1 where the checkpoint carries the MTP layer (`mtp.fc.weight`), else 0; more than one
    layer, or dedicated MTP embeddings, are refused by name."""
    if isinstance(ckpt, GgufCheckpoint) or MTP_PREFIX + "fc.weight" not in ckpt:
        return 0
    if any(t.startswith(MTP_PREFIX + "layers.") and not t.startswith(MTP_PREFIX + "layers.0.") for t in ckpt.tensors):
        raise hf.unsupported("more than one MTP layer (mtp.layers.1.*)", "one MTP layer (mtp.layers.0)")
    if MTP_PREFIX + "embed_tokens.weight" in ckpt:
        raise hf.unsupported("dedicated MTP embeddings (mtp.embed_tokens)", "the MTP layer sharing the model's")
    return 1


# ---------------------------------------------------------------- tensors


def _plus_one(name: str, shape: tuple[int, ...]) -> Derived:
    return Derived(((name, shape),), lambda w: w + np.float32(1.0), "1 + w")


def _split_q_gate(cfg: ModelConfig, name: str, part: int) -> Derived:
    h, hd, d = cfg.n_heads, cfg.head_dim, cfg.hidden_size
    make = lambda w: w.reshape(h, 2, hd, d)[:, part].reshape(h * hd, d)  # noqa: E731  per head [query; gate]
    return Derived(((name, (2 * h * hd, d)),), make, ("query", "gate")[part] + " rows")


def _qwen3_next_projections(cfg: ModelConfig, a: str) -> dict[str, Derived]:
    """De-interleave in_proj_qkvz [Hk (2 dk + 2 r dv), D] and in_proj_ba [Hk 2r, D] (per key head)."""
    n, d = TensorNames, cfg.hidden_size
    hk, dk, dv = cfg.deltanet.linear_k_heads, cfg.deltanet.linear_k_head_dim, cfg.deltanet.linear_v_head_dim
    r = cfg.deltanet.linear_v_heads // hk
    group = 2 * dk + 2 * r * dv
    qkvz = (a + "in_proj_qkvz.weight", (hk * group, d))
    ba = (a + "in_proj_ba.weight", (hk * 2 * r, d))

    def qkv(w):
        g = w.reshape(hk, group, d)  # [Hk, q | k | v | z, D]
        q, k, v = g[:, :dk], g[:, dk:2 * dk], g[:, 2 * dk:2 * dk + r * dv]
        return np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])

    return {
        n.ssm_qkv: Derived((qkvz,), qkv, "q | k | v rows"),
        n.ssm_z: Derived((qkvz,), lambda w: w.reshape(hk, group, d)[:, 2 * dk + r * dv:].reshape(-1, d), "z rows"),
        n.ssm_beta: Derived((ba,), lambda w: w.reshape(hk, 2 * r, d)[:, :r].reshape(-1, d), "b rows"),
        n.ssm_alpha: Derived((ba,), lambda w: w.reshape(hk, 2 * r, d)[:, r:].reshape(-1, d), "a rows"),
    }


def _layer_sources(cfg: ModelConfig, layer: int, prefix: str) -> dict[str, str | Derived]:
    n, d = TensorNames, cfg.hidden_size
    lp = f"{prefix}layers.{layer}."
    out: dict[str, str | Derived] = {
        n.attn_norm: _plus_one(lp + "input_layernorm.weight", (d,)),
        n.ffn_norm: _plus_one(lp + "post_attention_layernorm.weight", (d,)),
        n.router: lp + "mlp.gate.weight",
        n.shexp_gate: lp + "mlp.shared_expert.gate_proj.weight", n.shexp_up: lp + "mlp.shared_expert.up_proj.weight",
        n.shexp_down: lp + "mlp.shared_expert.down_proj.weight", n.shexp_gate_inp: lp + "mlp.shared_expert_gate.weight",
    }
    if cfg.kinds[layer].mixer is Mixer.ATTENTION:
        a = lp + "self_attn."
        out.update({n.attn_q: _split_q_gate(cfg, a + "q_proj.weight", 0),
                    n.attn_gate: _split_q_gate(cfg, a + "q_proj.weight", 1),
                    n.attn_k: a + "k_proj.weight", n.attn_v: a + "v_proj.weight", n.attn_output: a + "o_proj.weight",
                    n.attn_q_norm: _plus_one(a + "q_norm.weight", (cfg.head_dim,)),
                    n.attn_k_norm: _plus_one(a + "k_norm.weight", (cfg.head_dim,))})
        return out
    a = lp + "linear_attn."
    hv = cfg.deltanet.linear_v_heads
    if cfg.architecture == "qwen3_next":
        out.update(_qwen3_next_projections(cfg, a))
    else:
        out.update({n.ssm_qkv: a + "in_proj_qkv.weight", n.ssm_z: a + "in_proj_z.weight",
                    n.ssm_beta: a + "in_proj_b.weight", n.ssm_alpha: a + "in_proj_a.weight"})
    out.update({n.ssm_conv: a + "conv1d.weight",  # [C, 1, K] -> [C, K]: a unit axis
                n.ssm_a: Derived(((a + "A_log", (hv,)),), lambda w: -np.exp(w), "-exp"),
                n.ssm_dt_bias: a + "dt_bias", n.ssm_norm: a + "norm.weight", n.ssm_out: a + "out_proj.weight"})
    return out


def _mtp_sources(cfg: ModelConfig) -> dict[str, str | Derived]:
    """The MTP layer's dense tensors (MTP_NAMES) from the checkpoint's `mtp.*`."""
    d, m = cfg.hidden_size, MTP_PREFIX
    lp, a, mlp = m + "layers.0.", m + "layers.0.self_attn.", m + "layers.0.mlp."
    hf_names = {"fc": m + "fc.weight", "q": a + "q_proj.weight", "k": a + "k_proj.weight", "v": a + "v_proj.weight",
                "o": a + "o_proj.weight", "router": mlp + "gate.weight",
                "shared_gate": mlp + "shared_expert.gate_proj.weight", "shared_up": mlp + "shared_expert.up_proj.weight",
                "shared_down": mlp + "shared_expert.down_proj.weight",
                "shared_expert_gate": mlp + "shared_expert_gate.weight"}
    norms = {"norm_embedding": (m + "pre_fc_norm_embedding.weight", (d,)),
             "norm_hidden": (m + "pre_fc_norm_hidden.weight", (d,)), "norm": (m + "norm.weight", (d,)),
             "input_norm": (lp + "input_layernorm.weight", (d,)),
             "post_attention_norm": (lp + "post_attention_layernorm.weight", (d,)),
             "q_norm": (a + "q_norm.weight", (cfg.head_dim,)), "k_norm": (a + "k_norm.weight", (cfg.head_dim,))}
    out: dict[str, str | Derived] = {MTP_NAMES[f]: src for f, src in hf_names.items()}
    out.update({MTP_NAMES[f]: _plus_one(src, shape) for f, (src, shape) in norms.items()})
    for e in range(cfg.n_experts):
        out.update({mtp_expert_name(p, e): f"{mlp}experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")})
    return out


def skipped_by_prefix(ckpt: Checkpoint, prefixes: dict[str, str]) -> tuple[list[str], list[str]]:
    """The checkpoint's tensors under each skipped prefix (prefix -> what it is), and one note
    per prefix that has any: (tensor names, notes)."""
    skipped, notes = [], []
    for start, what in prefixes.items():
        names = [t for t in ckpt.tensors if t.startswith(start)]
        if names:
            skipped += names
            notes.append(f"skipped {what}: {len(names)} tensors")
    return skipped, notes


def untile_value_heads(x: np.ndarray, axis: int, k_heads: int, per_k: int, head_dim: int) -> np.ndarray:
    """Inverse of llama.cpp's Qwen3.5 value-head reorder along `axis` (its rows per value head:
    `head_dim`): tiled [per_k, k_heads, head_dim] (v0 of every key head, then v1, ...) back to
    the checkpoint's grouped [k_heads, per_k, head_dim]."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(per_k, k_heads, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(x, 0, axis))


def gguf_tensor_plan(cfg: ModelConfig, ckpt: GgufCheckpoint) -> TensorPlan:
    """Where every strata tensor of llama.cpp's `qwen3next` / `qwen35moe` GGUF comes from. Its
    converter already made most of them what strata computes with: the zero-centred norms hold
    1 + w, `ssm_a` is -exp(A_log), `ssm_conv1d` is [C, K], Qwen3-Next's in_proj_qkvz is regrouped
    into flat `attn_qkv` (q | k | v) and `attn_gate` (z); what is left: `attn_q` holds each head's
    [query; gate] (split as from Hugging Face); Qwen3-Next's `ssm_ba` is in_proj_ba as the
    checkpoint groups it ([b, a] per key head); Qwen3.5's value heads, where there are more than
    key heads, are tiled by llama.cpp (v rows of attn_qkv, attn_gate, ssm_beta / ssm_alpha,
    ssm_a, ssm_dt, the v channels of ssm_conv1d, ssm_out's columns) and are put back grouped
    (`untile_value_heads`, rows moved only). The legacy fused `ssm_in` is refused by name."""
    n, d = TensorNames, cfg.hidden_size
    key = lambda name: ckpt.key(name)  # noqa: E731  the name ckpt.tensors lists it under
    sources: dict[str, str | Derived] = {n.token_embd: key("token_embd.weight"),
                                         n.output_norm: key("output_norm.weight")}
    if not cfg.tie_embeddings:
        sources[n.output] = key("output.weight")
    hk, r = cfg.deltanet.linear_k_heads, cfg.deltanet.linear_v_heads // max(cfg.deltanet.linear_k_heads, 1)
    for layer in range(cfg.n_layers):
        b = f"blk.{layer}."
        if b + "ssm_in.weight" in ckpt.gguf_tensors:
            raise ConfigError(f"{ckpt.path}: tensor {b}ssm_in.weight: llama.cpp's legacy fused q/k/v/z layout is not "
                              "read; convert the checkpoint again with a current llama.cpp (attn_qkv + attn_gate)")
        out: dict[str, str | Derived] = {
            n.attn_norm: key(b + "attn_norm.weight"), n.ffn_norm: key(b + "post_attention_norm.weight"),
            n.router: key(b + "ffn_gate_inp.weight"), n.shexp_gate: key(b + "ffn_gate_shexp.weight"),
            n.shexp_up: key(b + "ffn_up_shexp.weight"), n.shexp_down: key(b + "ffn_down_shexp.weight"),
            n.shexp_gate_inp: key(b + "ffn_gate_inp_shexp.weight"),
        }
        if cfg.kinds[layer].mixer is Mixer.ATTENTION:
            q = key(b + "attn_q.weight")
            out.update({n.attn_q: _split_q_gate(cfg, q, 0), n.attn_gate: _split_q_gate(cfg, q, 1),
                        n.attn_k: key(b + "attn_k.weight"), n.attn_v: key(b + "attn_v.weight"),
                        n.attn_output: key(b + "attn_output.weight"), n.attn_q_norm: key(b + "attn_q_norm.weight"),
                        n.attn_k_norm: key(b + "attn_k_norm.weight")})
        elif ckpt.arch == "qwen3next":
            ba = (key(b + "ssm_ba.weight"), (hk * 2 * r, d))
            out.update({
                n.ssm_qkv: key(b + "attn_qkv.weight"), n.ssm_z: key(b + "attn_gate.weight"),
                n.ssm_beta: Derived((ba,), lambda w: w.reshape(hk, 2 * r, d)[:, :r].reshape(-1, d), "b rows"),
                n.ssm_alpha: Derived((ba,), lambda w: w.reshape(hk, 2 * r, d)[:, r:].reshape(-1, d), "a rows"),
                n.ssm_conv: key(b + "ssm_conv1d.weight"), n.ssm_a: key(b + "ssm_a"),
                n.ssm_dt_bias: key(b + "ssm_dt.bias"), n.ssm_norm: key(b + "ssm_norm.weight"),
                n.ssm_out: key(b + "ssm_out.weight")})
        else:  # qwen35moe
            out.update(_qwen35_gguf_deltanet(cfg, ckpt, b))
        sources.update({n.block(layer, k): v for k, v in out.items()})
    return TensorPlan(GgufExpertTensors(ckpt, cfg), sources)


def _qwen35_gguf_deltanet(cfg: ModelConfig, ckpt: GgufCheckpoint, b: str) -> dict[str, str | Derived]:
    """A Qwen3.5 DeltaNet layer of llama.cpp's GGUF, its value heads grouped again where llama.cpp
    tiled them (gguf_tensor_plan's doc)."""
    n, d, dn = TensorNames, cfg.hidden_size, cfg.deltanet
    hk, hv, dk, dv = dn.linear_k_heads, dn.linear_v_heads, dn.linear_k_head_dim, dn.linear_v_head_dim
    r = hv // hk
    names = {t: ckpt.key(b + g) for t, g in (
        (n.ssm_qkv, "attn_qkv.weight"), (n.ssm_z, "attn_gate.weight"), (n.ssm_beta, "ssm_beta.weight"),
        (n.ssm_alpha, "ssm_alpha.weight"), (n.ssm_conv, "ssm_conv1d.weight"), (n.ssm_a, "ssm_a"),
        (n.ssm_dt_bias, "ssm_dt.bias"), (n.ssm_norm, "ssm_norm.weight"), (n.ssm_out, "ssm_out.weight"))}
    if r == 1:  # as many value heads as key heads: llama.cpp moves nothing
        return names
    qk = 2 * hk * dk
    untile = lambda axis, hd: lambda w: untile_value_heads(w, axis, hk, r, hd)  # noqa: E731

    def rows_after_qk(w):  # attn_qkv [2 Hk dk + Hv dv, D], ssm_conv1d [2 Hk dk + Hv dv, K]: only the v rows
        return np.concatenate([w[:qk], untile_value_heads(w[qk:], 0, hk, r, dv)])

    conv_shape = ckpt.shape(names[n.ssm_conv])
    return {
        n.ssm_qkv: Derived(((names[n.ssm_qkv], (qk + hv * dv, d)),), rows_after_qk, "value heads grouped"),
        n.ssm_z: Derived(((names[n.ssm_z], (hv * dv, d)),), untile(0, dv), "value heads grouped"),
        n.ssm_beta: Derived(((names[n.ssm_beta], (hv, d)),), untile(0, 1), "value heads grouped"),
        n.ssm_alpha: Derived(((names[n.ssm_alpha], (hv, d)),), untile(0, 1), "value heads grouped"),
        n.ssm_conv: Derived(((names[n.ssm_conv], tuple(conv_shape)),), rows_after_qk, "value heads grouped"),
        n.ssm_a: Derived(((names[n.ssm_a], (hv,)),), untile(0, 1), "value heads grouped"),
        n.ssm_dt_bias: Derived(((names[n.ssm_dt_bias], (hv,)),), untile(0, 1), "value heads grouped"),
        n.ssm_norm: names[n.ssm_norm],
        n.ssm_out: Derived(((names[n.ssm_out], (d, hv * dv)),), untile(1, dv), "value columns grouped"),
    }


def tensor_plan(cfg: ModelConfig, ckpt: Checkpoint) -> TensorPlan:
    """Where every strata tensor of a hybrid checkpoint comes from (see the module doc)."""
    if isinstance(ckpt, GgufCheckpoint):
        return gguf_tensor_plan(cfg, ckpt)
    n = TensorNames
    prefix = PREFIX.get(cfg.architecture, "model.")
    sources: dict[str, str | Derived] = {n.token_embd: prefix + "embed_tokens.weight",
                                         n.output_norm: _plus_one(prefix + "norm.weight", (cfg.hidden_size,))}
    if not cfg.tie_embeddings:
        sources[n.output] = "lm_head.weight"
    for layer in range(cfg.n_layers):
        sources.update({n.block(layer, k): v for k, v in _layer_sources(cfg, layer, prefix).items()})
    if cfg.deltanet.mtp_layers:
        sources.update(_mtp_sources(cfg))
    experts = ExpertTensors(ckpt, cfg, "mlp", ("gate_proj", "up_proj", "down_proj"),
                            layer_prefix=prefix + "layers.{}.")
    skipped, notes = skipped_by_prefix(ckpt, SKIPPED_PREFIXES)
    return TensorPlan(experts, sources, tuple(skipped), tuple(notes))


_FEATURES = ("gated DeltaNet and gated attention layers, partial rotary (text positions of the multimodal "
             "sections), zero-centred norms, routed SwiGLU experts (per expert or fused gate_up_proj), "
             "a gated shared expert")
QWEN3_NEXT = Family(name="Qwen3-Next", model_types=("qwen3_next",), model_config=hybrid_config,
                    supported_features=_FEATURES, tensor_plan=tensor_plan)
QWEN3_5_MOE = Family(name="Qwen3.5-MoE", model_types=("qwen3_5_moe_text", MULTIMODAL), model_config=hybrid_config,
                     supported_features=_FEATURES, tensor_plan=tensor_plan)
