"""Sampling (pure): greedy, temperature, top-p, seeded per step so a run is reproducible."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplerConfig:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return (z - np.log(np.exp(z).sum(axis=-1, keepdims=True))).astype(np.float32)


def _kept(logits: np.ndarray, cfg: SamplerConfig) -> tuple[np.ndarray, np.ndarray]:
    """The tokens sampling may pick (by probability, stable order) and their renormalized
    probabilities: temperature, then the smallest top-p prefix. Shapes: [V] -> [n], [n]"""
    probs = np.exp(log_softmax(logits / np.float32(cfg.temperature)).astype(np.float64))
    order = np.argsort(-probs, kind="stable")
    if cfg.top_p < 1.0:
        cumulative = np.cumsum(probs[order])
        keep = int(np.searchsorted(cumulative, cfg.top_p) + 1)  # smallest prefix with mass >= top_p
        order = order[:keep]
    return order, probs[order] / probs[order].sum()


def probabilities(logits: np.ndarray, cfg: SamplerConfig) -> np.ndarray:
    """The distribution `sample` draws from, over the whole vocabulary (greedy: a point mass on
    the argmax). What speculative sampling accepts against.

    Shapes: logits [V] -> float64 [V], summing to 1
    """
    logits = np.asarray(logits, dtype=np.float32)
    out = np.zeros(logits.shape[-1], np.float64)
    if cfg.temperature == 0.0:
        out[int(np.argmax(logits))] = 1.0
        return out
    order, kept = _kept(logits, cfg)
    out[order] = kept
    return out


def sample(logits: np.ndarray, cfg: SamplerConfig, step: int) -> int:
    """Pick the next token from one position's logits [vocab].

    The random draw for step n comes from a generator seeded with (seed, n), so the token at a
    step depends only on the seed, the step and the logits: no hidden generator state.
    """
    logits = np.asarray(logits, dtype=np.float32)
    if cfg.temperature == 0.0:
        return int(np.argmax(logits))
    order, kept = _kept(logits, cfg)
    rng = np.random.default_rng([cfg.seed, step])
    return int(order[rng.choice(len(order), p=kept)])
