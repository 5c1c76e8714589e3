"""The architecture of a model: one frozen dataclass, stored in the GGUF file's metadata.

A model is a stack of layers, each a token mixer followed by a feed-forward block; the kind of
each (`layer_types`: attention today, room for linear attention, latent attention, indexed
attention; a routed MoE or a dense FFN) says which state the layer keeps and which loop branch
computes it. Every engine has one loop over layers that dispatches on the kind. Routed experts
exist only in MoE layers: the `.experts` file, the expert cache and the read-ahead count MoE
layers only, addressed by their MoE index (`moe_index`), so a dense layer costs no cache turn.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from strata import layer_kinds
from strata.errors import ConfigError
from strata.families.deepseek import nextn_tensor_shapes
from strata.families.qwen4_exp import qwen4_tensor_shapes
from strata.families.qwen_hybrid import mtp_tensor_shapes
from strata.families.registry import FAMILIES, FamilyFields
from strata.layer_kinds import (  # noqa: F401  (re-exported: the model's vocabulary, spoken through this module)
    MOE_LAYER, ExpertKind, Ffn, LayerType, Mixer, QKNorm, ResidualKind, RopeScaling, RoutingOrder,
)
from strata.tensor_names import (  # noqa: F401  (re-exported)
    MIXER_TENSORS, TensorNames, attention_tensor_shapes, deltanet_tensor_shapes, mla_tensor_shapes,
)


@dataclass(frozen=True)
class ModelConfig(FamilyFields):
    """The fields every family shares; each family's own are its dataclass, an attribute inherited
    from `FamilyFields` (strata/families/registry.py). Stored flat: `to_dict` / `from_dict` speak
    the GGUF metadata's keys, one per field of either kind."""

    architecture: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    n_experts_per_token: int
    expert_ffn_size: int
    shared_ffn_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # Qwen2-MoE: shared output * sigmoid(w . x)
    routing_order: RoutingOrder = RoutingOrder.SOFTMAX_TOPK
    norm_topk_prob: bool = True
    qk_norm: QKNorm = QKNorm.NONE
    attention_bias: bool = False  # Qwen2-MoE: q/k/v projections carry a bias
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_context: int = 4096
    tie_embeddings: bool = False
    # per layer: mixer and ffn kinds. () (the canonical form when every layer is attention + MoE,
    # so `replace(cfg, n_layers=...)` keeps working on such models); read it through `kinds`
    layer_types: tuple[LayerType, ...] = ()
    dense_ffn_size: int = 0  # width of the dense FFN layers (0: the model has none)
    # partial rotary (Qwen3-Next / Qwen3.5, Qwen4-Exp, GLM-4.5, MiniMax-M2) and the gated attention
    # output (Qwen3-Next / Qwen3.5, Qwen4-Exp): fields of several families, so they stay shared
    rotary_dim: int = 0  # RoPE over the first rotary_dim dims of each head (0: the whole head)
    attention_output_gate: bool = False  # attention output * sigmoid(x · W_gate) before o_proj

    def __post_init__(self) -> None:
        types = tuple(t if isinstance(t, LayerType) else LayerType.from_str(t) for t in self.layer_types)
        if all(t == MOE_LAYER for t in types):
            types = ()
        object.__setattr__(self, "layer_types", types)
        kinds = types or (MOE_LAYER,) * max(self.n_layers, 0)
        object.__setattr__(self, "_kinds", kinds)
        moe = tuple(l for l, t in enumerate(kinds) if t.ffn is Ffn.MOE)
        object.__setattr__(self, "_moe_layers", moe)
        positive = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "n_experts", "n_experts_per_token", "expert_ffn_size", "max_context")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model config: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.n_experts_per_token > self.n_experts:
            raise ConfigError(f"model config: top-{self.n_experts_per_token} of only {self.n_experts} experts")
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if types and len(types) != self.n_layers:
            raise ConfigError(f"model config: layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        if not moe:
            raise ConfigError("model config: no MoE layer (strata runs mixture-of-experts models)")
        if any(t.ffn is Ffn.DENSE for t in kinds) and self.dense_ffn_size <= 0:
            raise ConfigError("model config: dense FFN layers need dense_ffn_size > 0")
        # Values a forward pass cannot use (NaN/0/-1 theta, a negative or NaN eps) are refused here,
        # so `strata convert` and every reader name the field instead of a later NaN in routing.
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"model config: {name} must be a finite number > 0, got {value!r}")
        if self.rotary_dim and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ConfigError(f"model config: rotary_dim must be even and in (0, head_dim={self.head_dim}], "
                              f"got {self.rotary_dim}")
        for family in FAMILIES:  # each family's own fields (strata/families/)
            family.check(self)

    @property
    def rope_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (rotary_dim, or the whole head)."""
        return self.rotary_dim or self.head_dim

    @property
    def kinds(self) -> tuple[LayerType, ...]:
        """Every layer's kind, in order (`layer_types` spelled out)."""
        return self._kinds

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The model indices of the MoE layers, in order (MoE index i is layer moe_layers[i])."""
        return self._moe_layers

    @property
    def n_moe_layers(self) -> int:
        return len(self._moe_layers)

    def moe_index(self, layer: int) -> int:
        """The MoE index of model layer `layer` (its layer in the `.experts` file and the cache)."""
        return self._moe_layers.index(layer)

    def is_moe(self, layer: int) -> bool:
        return self._kinds[layer].ffn is Ffn.MOE

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_ffn_size > 0

    @property
    def residual(self) -> ResidualKind:
        """The residual stream's kind: hyper-connections where the model has streams (Qwen4-Exp)."""
        return ResidualKind.HYPER_CONNECTIONS if self.qwen4.hc_count else ResidualKind.PLAIN

    @classmethod
    def stored_fields(cls) -> tuple[dataclasses.Field, ...]:
        """Every field as stored (one GGUF key each): the shared ones, then each family's."""
        return tuple(f for f in dataclasses.fields(cls) if f.name not in _PARTS) + tuple(
            f for part in _PARTS.values() for f in dataclasses.fields(part))

    def flat(self) -> dict:
        """Every stored field by name, its value as held (enums, a LayerType tuple)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _PARTS}
        for name in _PARTS:
            part = getattr(self, name)
            out.update({f.name: getattr(part, f.name) for f in dataclasses.fields(part)})
        return out

    def with_fields(self, **changes) -> "ModelConfig":
        """This config with stored fields replaced by name, whichever family's they are
        (`cfg.with_fields(n_layers=3, sliding_window=4)`)."""
        return ModelConfig.from_dict({**self.flat(), **changes})

    def to_dict(self) -> dict:
        out = self.flat()
        for name, value in out.items():
            if isinstance(value, enum.Enum):  # stored as its string value
                out[name] = value.value
        out["layer_types"] = ",".join(t.to_str() for t in self.layer_types)  # one GGUF string ("": uniform)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """A config from its stored fields by name (the GGUF metadata's keys; enum values or their
        strings); unknown keys are refused."""
        unknown = set(d) - set(_FIELD_PART)
        if unknown:
            raise ConfigError(f"model config: unknown keys {sorted(unknown)}")
        d = dict(d)
        for name, kind in _ENUM_FIELDS.items():
            if name in d:
                d[name] = kind(d[name])
        if "layer_types" in d:
            types = d["layer_types"]
            types = types.split(",") if isinstance(types, str) else types
            d["layer_types"] = tuple(t if isinstance(t, LayerType) else LayerType.from_str(t) for t in types if t)
        shared = {k: v for k, v in d.items() if _FIELD_PART[k] is None}
        parts = {name: part(**{k: v for k, v in d.items() if _FIELD_PART[k] == name}) for name, part in _PARTS.items()}
        return cls(**shared, **parts)


# each family's part: its attribute on ModelConfig -> its dataclass
_PARTS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(FamilyFields)}  # type: ignore[misc]
# every stored field -> the part holding it (None: a shared field)
_FIELD_PART: dict[str, str | None] = {f.name: None for f in dataclasses.fields(ModelConfig) if f.name not in _PARTS}
for _name, _part in _PARTS.items():
    for _f in dataclasses.fields(_part):
        assert _f.name not in _FIELD_PART, f"the stored field {_f.name} is in two parts of ModelConfig"
        _FIELD_PART[_f.name] = _name


def stored_enum(field: dataclasses.Field) -> type[enum.Enum] | None:
    """The enum (of strata/layer_kinds.py) a stored field holds, stored as its string value; None
    for a plain value."""
    kind = getattr(layer_kinds, str(field.type), None)
    return kind if isinstance(kind, type) and issubclass(kind, enum.Enum) else None


_ENUM_FIELDS = {f.name: kind for f in ModelConfig.stored_fields() if (kind := stored_enum(f)) is not None}


def dense_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every dense tensor the model needs, with its shape. One list for writers, readers, checks."""
    if cfg.residual is ResidualKind.HYPER_CONNECTIONS:  # Qwen4-Exp: hyper-connection norms, not pre-norms; PLE, indexer
        return qwen4_tensor_shapes(cfg)
    n = TensorNames
    shapes: dict[str, tuple[int, ...]] = {n.token_embd: (cfg.vocab_size, cfg.hidden_size),
                                          n.output_norm: (cfg.hidden_size,)}
    if not cfg.tie_embeddings:
        shapes[n.output] = (cfg.vocab_size, cfg.hidden_size)
    for l in range(cfg.n_layers):
        shapes.update(layer_tensor_shapes(cfg, l, cfg.kinds[l]))
    shapes.update(mtp_tensor_shapes(cfg))  # the hybrids' kept MTP layer (strata/families/qwen_hybrid.py)
    # the sigmoid families' kept nextn layer (strata/families/deepseek.py): an MoE layer's tensors and its own
    if cfg.sigmoid.nextn_layers:
        shapes.update(nextn_tensor_shapes(cfg, layer_tensor_shapes(cfg, 0, cfg.kinds[cfg.moe_layers[0]])))
    return shapes


def layer_tensor_shapes(cfg: ModelConfig, l: int, kind: LayerType) -> dict[str, tuple[int, ...]]:
    """Layer l's dense tensors (`blk.{l}.*`) for a layer of `kind`, with their shapes."""
    n = TensorNames
    b = lambda s: n.block(l, s)  # noqa: E731
    shapes = {b(n.attn_norm): (cfg.hidden_size,)}
    shapes.update(MIXER_TENSORS[kind.mixer](cfg, l))
    shapes[b(n.ffn_norm)] = (cfg.hidden_size,)
    if kind.ffn is Ffn.DENSE:
        shapes[b(n.ffn_gate)] = (cfg.dense_ffn_size, cfg.hidden_size)
        shapes[b(n.ffn_up)] = (cfg.dense_ffn_size, cfg.hidden_size)
        shapes[b(n.ffn_down)] = (cfg.hidden_size, cfg.dense_ffn_size)
        return shapes
    shapes[b(n.router)] = (cfg.n_experts, cfg.hidden_size)
    if cfg.sigmoid.router_bias:
        shapes[b(n.exp_probs_b)] = (cfg.n_experts,)
    if cfg.gpt_oss.router_logit_bias:
        shapes[b(n.router_logit_bias)] = (cfg.n_experts,)
    if cfg.has_shared_expert:
        shapes[b(n.shexp_gate)] = (cfg.shared_ffn_size, cfg.hidden_size)
        shapes[b(n.shexp_up)] = (cfg.shared_ffn_size, cfg.hidden_size)
        shapes[b(n.shexp_down)] = (cfg.hidden_size, cfg.shared_ffn_size)
        if cfg.shared_expert_gated:
            shapes[b(n.shexp_gate_inp)] = (cfg.hidden_size,)
    return shapes




# ---------------------------------------------------------------- a layer range (pipeline stages)


@dataclass(frozen=True)
class LayerRange:
    """Layers [start, stop) of an n_layers model: the part of it one pipeline stage computes.

    The loops (reference `forward`, the streaming window and prompt path) iterate `layers`; the
    first range embeds tokens, the last computes logits, and the others take and give the hidden
    state [T, D]. Its MoE layers are MoE indices [moe_start, moe_stop) of the `.experts` file;
    the stage's cache counts only those (local index m - moe_start)."""

    start: int
    stop: int
    n_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.n_layers:
            raise ConfigError(f"layer range [{self.start}, {self.stop}) is not a non-empty part of {self.n_layers} layers")

    @staticmethod
    def whole(cfg: ModelConfig) -> "LayerRange":
        return LayerRange(0, cfg.n_layers, cfg.n_layers)

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    @property
    def embeds(self) -> bool:
        """The first range: its input is token ids."""
        return self.start == 0

    @property
    def heads(self) -> bool:
        """The last range: its output is logits."""
        return self.stop == self.n_layers

    def moe_layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The model indices of this range's MoE layers (local MoE index i is moe_layers[i])."""
        return tuple(l for l in cfg.moe_layers if self.start <= l < self.stop)

    def moe_start(self, cfg: ModelConfig) -> int:
        """How many MoE layers come before this range (its first MoE layer's MoE index)."""
        return sum(1 for l in cfg.moe_layers if l < self.start)

    def dense_names(self, cfg: ModelConfig) -> tuple[str, ...]:
        """The dense tensors this range computes with: its layers' blocks, the embedding on the
        first range, the final norm and head on the last (the embedding too when it is tied)."""
        n = TensorNames
        prefixes = tuple(n.block(l, "") for l in self.layers)
        ends = ((n.token_embd,) if self.embeds or (self.heads and cfg.tie_embeddings) else ()) + (
            (n.output_norm, n.output) if self.heads else ())
        return tuple(name for name in dense_tensor_shapes(cfg) if name.startswith(prefixes) or name in ends)
