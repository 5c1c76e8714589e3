"""What every supported architecture shares: the Llama-style tensor names of a Hugging Face MoE
decoder, mapped onto strata's (llama.cpp-spelled) `TensorNames`, and the routed-expert reader.

An architecture family (`Family`) differs only in how its config becomes a ModelConfig, where
its MoE block lives (`mlp` or Mixtral's `block_sparse_moe`) and what its per-expert projections
are called (`gate_proj/up_proj/down_proj` or Mixtral's `w1/w3/w2`).

Routed experts come in two on-disk layouts, both read here:
- per expert (every checkpoint on the Hub, and what transformers 5's `save_pretrained` writes):
  `{moe}.experts.{e}.{gate,up,down}` as [F, D], [F, D], [D, F];
- fused (transformers 5's in-memory layout, written by some tools): `{moe}.experts.gate_up_proj`
  [E, 2F, D] (gate rows, then up rows) and `{moe}.experts.down_proj` [E, D, F]. One expert is
  read as a slice of the fused tensor, never the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.errors import ConfigError, FormatError
from strata.model_config import ModelConfig, TensorNames, dense_tensor_shapes

LAYER = "model.layers.{}."
# tensors a checkpoint may carry that the forward pass recomputes (old Llama-style exports)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Family:
    """One architecture family: `model_types` are the config.json `model_type` values it takes."""

    name: str
    model_types: tuple[str, ...]
    model_config: Callable[[HFConfig, Checkpoint], ModelConfig]
    moe_blocks: tuple[str, ...] = ("mlp",)  # candidate names of the MoE block, in preference order
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    supported_features: str = ""  # for error messages: what this family may use
    # a family whose tensors are not the Llama names one to one (a prefix, fused or derived
    # tensors, skipped towers): (cfg, checkpoint) -> convert.tensor_plan.TensorPlan
    tensor_plan: Callable | None = None
    # a family whose largest tables go into a third file beside the pair (Qwen4-Exp's n-gram row
    # store, when the config says `ple_row_store`): (cfg, checkpoint, path, *, qtype, progress) -> the open file
    row_store: Callable | None = None


def base_fields(hf: HFConfig, ckpt: Checkpoint) -> dict:
    """The ModelConfig fields every family reads the same way."""
    hf.check_not_quantized()
    hf.check_activation()
    n_heads = hf.get_int("num_attention_heads")
    bias_key = "qkv_bias" if "qkv_bias" in hf.raw else "attention_bias"
    has_bias = (LAYER.format(0) + "self_attn.q_proj.bias") in ckpt
    return dict(
        architecture=hf.model_type,
        vocab_size=hf.get_int("vocab_size"),
        hidden_size=hf.get_int("hidden_size"),
        n_layers=hf.get_int("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=hf.get_int("num_key_value_heads", default=n_heads),
        head_dim=hf.head_dim(),
        n_experts=hf.get_int("num_experts", "num_local_experts"),
        n_experts_per_token=hf.get_int("num_experts_per_tok"),
        rms_norm_eps=hf.get_float("rms_norm_eps"),
        tie_embeddings=hf.get_bool("tie_word_embeddings", default=False),
        # the config says; old configs that predate the key are read from the tensors
        attention_bias=hf.get_bool(bias_key, default=has_bias),
    )


def dense_sources(cfg: ModelConfig, moe: str, extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """strata dense tensor name -> checkpoint tensor name, for every tensor of
    `dense_tensor_shapes(cfg)`. The shared expert's sigmoid gate is [1, D] in the checkpoint
    and [D] in strata (`reshape_to`)."""
    n = TensorNames
    out = {n.token_embd: "model.embed_tokens.weight", n.output_norm: "model.norm.weight"}
    if not cfg.tie_embeddings:
        out[n.output] = "lm_head.weight"
    per_layer = {
        n.attn_norm: "input_layernorm.weight",
        n.attn_q: "self_attn.q_proj.weight", n.attn_k: "self_attn.k_proj.weight",
        n.attn_v: "self_attn.v_proj.weight", n.attn_output: "self_attn.o_proj.weight",
        n.attn_q_bias: "self_attn.q_proj.bias", n.attn_k_bias: "self_attn.k_proj.bias",
        n.attn_v_bias: "self_attn.v_proj.bias",
        n.attn_q_norm: "self_attn.q_norm.weight", n.attn_k_norm: "self_attn.k_norm.weight",
        n.ffn_norm: "post_attention_layernorm.weight",
        n.router: f"{moe}.gate.weight",
        n.shexp_gate: f"{moe}.shared_expert.gate_proj.weight", n.shexp_up: f"{moe}.shared_expert.up_proj.weight",
        n.shexp_down: f"{moe}.shared_expert.down_proj.weight", n.shexp_gate_inp: f"{moe}.shared_expert_gate.weight",
    }
    per_layer.update({k: v.format(moe=moe) for k, v in extra})
    for name in dense_tensor_shapes(cfg):
        if name.startswith("blk."):
            _, layer, suffix = name.split(".", 2)
            out[name] = LAYER.format(layer) + per_layer[suffix]
    return out


def same_up_to_unit_axes(found: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """[1, D] and [D] are the same tensor (the shared expert's gate); [D, F] and [F, D] are not."""
    return [d for d in found if d != 1] == [d for d in want if d != 1]


def reshape_to(x: np.ndarray, want: tuple[int, ...], what: str) -> np.ndarray:
    """`x` in shape `want` if it only differs by unit axes ([1, D] -> [D]); else a FormatError."""
    if tuple(x.shape) == want:
        return x
    if same_up_to_unit_axes(tuple(x.shape), want):
        return x.reshape(want)
    raise FormatError(f"{what}: shape {list(x.shape)}, expected {list(want)}")


class ExpertTensors:
    """Reads routed expert (layer, e) from a checkpoint as float32 gate [F, D], up [F, D],
    down [D, F], whichever layout each layer uses. Checks every name and shape at construction,
    so a missing or misshapen expert fails before any output is written."""

    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, moe: str, projections: tuple[str, str, str],
                 layer_prefix: str = LAYER) -> None:
        self._ckpt = ckpt
        self._cfg = cfg
        self._names: list[tuple[str, ...]] = []  # per layer: 3 per-expert patterns or 2 fused names
        self.consumed: set[str] = set()
        f, d, n_exp = cfg.expert_ffn_size, cfg.hidden_size, cfg.n_experts
        for l in cfg.moe_layers:  # self._names is indexed by MoE index, as the .experts file
            base = layer_prefix.format(l) + f"{moe}.experts."
            fused = (base + "gate_up_proj", base + "down_proj")
            if fused[0] in ckpt:
                self._check(fused[0], (n_exp, 2 * f, d))
                self._check(fused[1], (n_exp, d, f))
                self._names.append(fused)
                self.consumed.update(fused)
                continue
            patterns = tuple(base + "{}." + p + ".weight" for p in projections)
            for e in range(n_exp):
                for pat, shape in zip(patterns, ((f, d), (f, d), (d, f))):
                    self._check(pat.format(e), shape)
                    self.consumed.add(pat.format(e))
            self._names.append(patterns)

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self._ckpt:
            raise FormatError(f"{self._ckpt.directory}: checkpoint has no tensor {name} "
                              f"(routed experts of a {self._cfg.architecture} model)")
        found = self._ckpt.shape(name)
        if found != shape:
            raise FormatError(f"{self._ckpt.directory}: tensor {name}: shape {list(found)}, expected {list(shape)} "
                              f"for experts={self._cfg.n_experts} ffn={self._cfg.expert_ffn_size} "
                              f"hidden={self._cfg.hidden_size}")
        self._ckpt.check_dtype(name)

    def read(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Shapes: -> gate [F, D], up [F, D], down [D, F], float32"""
        names = self._names[layer]
        if len(names) == 2:
            gate_up = self._ckpt.read(names[0], expert)  # [2F, D]
            f = self._cfg.expert_ffn_size
            return gate_up[:f], gate_up[f:], self._ckpt.read(names[1], expert)
        return tuple(self._ckpt.read(p.format(expert)) for p in names)  # type: ignore[return-value]


def find_moe_block(family: Family, ckpt: Checkpoint) -> str:
    """Which of the family's MoE block names this checkpoint uses (by its layer-0 router)."""
    for moe in family.moe_blocks:
        if LAYER.format(0) + f"{moe}.gate.weight" in ckpt:
            return moe
    tried = " or ".join(LAYER.format(0) + f"{m}.gate.weight" for m in family.moe_blocks)
    raise FormatError(f"{ckpt.directory}: no router tensor {tried} (not a {family.name} checkpoint?)")


def check_unused(ckpt: Checkpoint, used: set[str], cfg: ModelConfig, family: Family) -> None:
    """Refuse a checkpoint with tensors strata would drop: they mean a feature the reference
    does not compute (an output-projection bias, a dense MLP layer, ...)."""
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unused = sorted(n for n in ckpt.tensors if n not in used and n not in ignored and not n.endswith(IGNORED_SUFFIXES))
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise ConfigError(f"{ckpt.directory}: unsupported {family.name} checkpoint: tensors strata has no place for: "
                          f"{', '.join(unused[:3])}{more} (supported: {family.supported_features})")

