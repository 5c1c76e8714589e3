"""Made-model weights for gpt-oss's extras (the `gpt-oss` shape of strata.testing.models).

make_dense's defaults put ones in every 1-D tensor, which would make every head's sink logit 1
and every router bias 1 (a shift the softmax ignores): the sinks, the router's logit bias and the
output bias get small random values instead, so a test sees them matter; the experts get random
gate/up/down biases.
"""

from __future__ import annotations

import numpy as np

from strata.formats.expert_record import ExpertBiases
from strata.model_config import ModelConfig, TensorNames

SINK_STD = 1.0  # sink logits of the size attention scores have here, so they take a real share
ROUTER_LOGIT_BIAS_STD = 0.5
OUTPUT_BIAS_STD = 0.02
EXPERT_BIAS_STD = 0.1


def gpt_oss_dense(cfg: ModelConfig, layer: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The layer's sink, output-bias and router-bias tensors (those the config has)."""
    n = TensorNames
    b = lambda s: n.block(layer, s)  # noqa: E731
    out: dict[str, np.ndarray] = {}
    if cfg.gpt_oss.attention_sinks:
        out[b(n.attn_sinks)] = (rng.standard_normal(cfg.n_heads) * SINK_STD).astype(np.float32)
    if cfg.gpt_oss.attention_output_bias:
        out[b(n.attn_output_bias)] = (rng.standard_normal(cfg.hidden_size) * OUTPUT_BIAS_STD).astype(np.float32)
    if cfg.gpt_oss.router_logit_bias and cfg.is_moe(layer):
        out[b(n.router_logit_bias)] = (rng.standard_normal(cfg.n_experts) * ROUTER_LOGIT_BIAS_STD).astype(np.float32)
    return out


def expert_biases(cfg: ModelConfig, rng: np.random.Generator) -> ExpertBiases | None:
    """One expert's biases (None when the model's experts have none). gate, up [F], down [D]"""
    if not cfg.gpt_oss.expert_bias:
        return None
    f, d = cfg.expert_ffn_size, cfg.hidden_size
    draw = lambda k: (rng.standard_normal(k) * EXPERT_BIAS_STD).astype(np.float32)  # noqa: E731
    return ExpertBiases(draw(f), draw(f), draw(d))
