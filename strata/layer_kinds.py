"""What a layer is: its token mixer and feed-forward kinds, and the model-wide variants (enums).

The vocabulary every other part of the model's description speaks (model_config, the per-family
parts in strata/families/, the tensor names): kept apart from `ModelConfig` so that those parts
can name a layer kind without importing the config they are part of.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from strata.errors import ConfigError


class RoutingOrder(enum.Enum):
    """How router logits become k experts and their weights."""

    SOFTMAX_TOPK = "softmax_topk"  # Qwen/OLMoE: softmax over all, top-k, optional renormalization
    TOPK_SOFTMAX = "topk_softmax"  # Mixtral: top-k logits, softmax over those k
    SIGMOID_TOPK = "sigmoid_topk"  # DeepSeek-V3/GLM-4.5/MiniMax-M2: sigmoid + selection bias, groups (docs/routing.md)


class QKNorm(enum.Enum):
    """RMSNorm on queries and keys before RoPE."""

    NONE = "none"
    PER_HEAD = "per_head"  # Qwen3: one [head_dim] weight shared by all heads
    FULL = "full"  # OLMoE: over the whole [n_heads * head_dim] projection


class Mixer(enum.Enum):
    """A layer's token mixer: what it computes and what per-layer state it keeps."""

    ATTENTION = "attention"  # grouped-query softmax attention with RoPE; state: the KV cache
    DELTANET = "deltanet"  # gated DeltaNet linear attention (Qwen3-Next, Qwen3.5); state: conv + recurrent
    MLA = "mla"  # DeepSeek's multi-head latent attention; state: the compressed latent + rope key (reference/mla.py)
    # attention over the last `sliding_window` positions only (gpt-oss's alternate layers); state:
    # the KV cache, every position kept (so trim works for every n; the mask does the windowing)
    SLIDING_ATTENTION = "sliding_attention"
    # Qwen4-Exp's QSA: attention over the key blocks an indexer picks per query (reference/indexed_attention.py);
    # state: the KV cache and the indexer's keys
    INDEXED_ATTENTION = "indexed_attention"


class ExpertKind(enum.Enum):
    """What a routed expert computes from its three projections (and their biases, if any)."""

    SWIGLU = "swiglu"  # down(silu(gate x) * up x)
    # gpt-oss: g = min(gate x, limit), u = clip(up x, -limit, limit), down((u + 1) * g * sigmoid(alpha g))
    CLAMPED_SWIGLU = "clamped_swiglu"


class RopeScaling(enum.Enum):
    """How RoPE's frequencies are scaled for a longer context."""

    NONE = "none"
    YARN = "yarn"  # gpt-oss: NTK-by-parts interpolation and a cos/sin attention factor


class ResidualKind(enum.Enum):
    """How the hidden state is carried between blocks (reference/residual.py)."""

    PLAIN = "plain"  # one stream with pre-norms: x += block(rms_norm(x))
    # Qwen4-Exp: hc streams, each block read and written through a gated hyper-connection
    HYPER_CONNECTIONS = "hyper_connections"


class Ffn(enum.Enum):
    """A layer's feed-forward block."""

    MOE = "moe"  # router + routed experts (+ the shared expert when the model has one)
    DENSE = "dense"  # one SwiGLU of width dense_ffn_size on dense weights (DeepSeek's first layers)


@dataclass(frozen=True)
class LayerType:
    mixer: Mixer = Mixer.ATTENTION
    ffn: Ffn = Ffn.MOE

    def to_str(self) -> str:
        return f"{self.mixer.value}:{self.ffn.value}"

    @staticmethod
    def from_str(text: str) -> "LayerType":
        mixer, sep, ffn = str(text).partition(":")
        try:
            return LayerType(Mixer(mixer), Ffn(ffn if sep else Ffn.MOE.value))
        except ValueError:
            known = ", ".join(f"{m.value}:{f.value}" for m in Mixer for f in Ffn)
            raise ConfigError(f"model config: unknown layer type {text!r} (known: {known})") from None


MOE_LAYER = LayerType(Mixer.ATTENTION, Ffn.MOE)
