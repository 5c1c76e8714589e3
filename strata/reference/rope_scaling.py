"""RoPE frequencies with YaRN scaling (pure numpy), as gpt-oss configures it.

YaRN ("NTK-by-parts") keeps the fast-rotating dimensions as they are (extrapolation), divides
the slow ones' frequencies by `factor` (interpolation) and ramps linearly between, over the
dimensions whose wavelength at the pretraining context lies between `beta_fast` and
`beta_slow` rotations; cos and sin are then multiplied by an attention factor (0.1 ln(factor) + 1
unless the config gives one: the converter stores the value). This is transformers'
`_compute_yarn_parameters` in float64: gpt-oss sets `truncate: false`, so the correction range
keeps its fractional bounds.
"""

from __future__ import annotations

import math

import numpy as np

from strata.model_config import ModelConfig, RopeScaling

RAMP_EPS = 0.001  # transformers widens an empty ramp by this, to avoid dividing by zero


def yarn_correction_range(cfg: ModelConfig, dim: int | None = None) -> tuple[float, float]:
    """(low, high): the rotary dimension pairs where the ramp from extrapolation to interpolation
    runs. dim: the rotated dims (None: cfg.rope_dim; latent attention rotates qk_rope_head_dim)."""
    dim = cfg.rope_dim if dim is None else dim
    base, orig = cfg.rope_theta, cfg.yarn.yarn_original_context

    def correction_dim(rotations: float) -> float:  # the dim pair that turns `rotations` times over orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.yarn.yarn_beta_fast), correction_dim(cfg.yarn.yarn_beta_slow)
    if cfg.yarn.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0.0), min(high, dim - 1.0)


def rope_frequencies(cfg: ModelConfig, dim: int | None = None) -> tuple[np.ndarray, float]:
    """The inverse frequencies of the rotated dims and the factor cos and sin are scaled by.
    dim: the rotated dims (None: cfg.rope_dim).

    Shapes: -> (inv_freq float64 [dim / 2], attention factor)
    """
    dim = cfg.rope_dim if dim is None else dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # [dim/2]
    if cfg.yarn.rope_scaling is RopeScaling.NONE:
        return inv_freq, 1.0
    if cfg.yarn.rope_scaling is not RopeScaling.YARN:  # pragma: no cover - a new member must be handled here
        raise NotImplementedError(f"rope scaling {cfg.yarn.rope_scaling.value}")
    low, high = yarn_correction_range(cfg, dim)
    if low == high:
        high += RAMP_EPS
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolated = 1.0 - ramp  # 1: the dim keeps its frequency, 0: divided by the factor
    inv_freq = inv_freq / cfg.yarn.yarn_factor * (1.0 - extrapolated) + inv_freq * extrapolated
    return inv_freq, float(cfg.yarn.yarn_attention_factor)


def rope_cos_sin(cfg: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (times the attention factor) of every position's angles, float32.

    Shapes: positions [T] -> cos, sin [T, rope_dim / 2]
    """
    inv_freq, scale = rope_frequencies(cfg)
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]  # [T, rd/2]
    return (np.cos(angles) * scale).astype(np.float32), (np.sin(angles) * scale).astype(np.float32)


def scaled_rope(x: np.ndarray, positions: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """RoPE (rotate-half form, on the first rope_dim dims) with the config's scaled frequencies.

    Shapes:
        x: [H, T, hd]; positions: [T] -> [H, T, hd]
    """
    rd = cfg.rope_dim
    cos, sin = rope_cos_sin(cfg, positions)
    cos, sin = np.concatenate([cos, cos], axis=-1), np.concatenate([sin, sin], axis=-1)  # [T, rd]
    r = x[..., :rd]
    rotated = np.concatenate([-r[..., rd // 2:], r[..., :rd // 2]], axis=-1)
    return np.concatenate([r * cos + rotated * sin, x[..., rd:]], axis=-1)
