"""Made-model weights for gated DeltaNet layers (the `hybrid` shape of strata.testing.models).

make_dense's defaults (ones for every 1-D tensor, 1/sqrt(fan-in) matrices) would give a decay
rate a = +1, so exp(g) > 1 and the recurrent state would grow without bound. A DeltaNet layer
gets what a trained one looks like instead: a = -exp(A_log) with A in [1, 16] as transformers
initializes it, dt_bias near 0, a conv whose last tap (the current position) dominates, and the
output projection writing into the same low-rank context subspace attention writes into, so the
routers' locality survives the recurrent layers.
"""

from __future__ import annotations

import numpy as np

from strata.model_config import ModelConfig, TensorNames

A_RANGE = (1.0, 16.0)  # transformers' A_log init: log(uniform(...)); the decay rate is -A
CONV_LAST_TAP = 1.0  # weight of the current position in the causal conv (older taps are small noise)
CONV_NOISE = 0.2


def deltanet_dense(cfg: ModelConfig, layer: int, rng: np.random.Generator, basis: np.ndarray,
                   out_scale: float) -> dict[str, np.ndarray]:
    """The DeltaNet tensors of layer `layer` that replace make_dense's defaults.

    Shapes: basis [r, D] (the context subspace)"""
    n = TensorNames
    b = lambda s: n.block(layer, s)  # noqa: E731
    hv, kc = cfg.deltanet.linear_v_heads, cfg.deltanet.linear_conv_kernel
    c = 2 * cfg.deltanet.linear_k_heads * cfg.deltanet.linear_k_head_dim + hv * cfg.deltanet.linear_v_head_dim
    conv = (rng.standard_normal((c, kc)) * CONV_NOISE).astype(np.float32)
    conv[:, -1] += CONV_LAST_TAP
    v_dim = hv * cfg.deltanet.linear_v_head_dim
    out = basis.T @ rng.standard_normal((basis.shape[0], v_dim)) * out_scale / np.sqrt(basis.shape[0])
    return {
        b(n.ssm_a): -rng.uniform(*A_RANGE, hv).astype(np.float32),
        b(n.ssm_dt_bias): (rng.standard_normal(hv) * 0.1).astype(np.float32),
        b(n.ssm_conv): conv,
        b(n.ssm_out): out.astype(np.float32),
    }
