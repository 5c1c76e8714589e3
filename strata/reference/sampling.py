"""Sampling (pure): greedy, temperature, top-k, min-p, top-p, a repetition penalty and OpenAI's
frequency and presence penalties, seeded per step so a run is reproducible.

The order of one step (every filter is off at its default):
    1. repetition penalty on the raw logits of the tokens in the last `repeat_window` of the
       history (prompt and generated): a positive logit is divided by the penalty, a negative
       one multiplied (the CTRL rule llama.cpp and transformers use), so a repeated token
       always loses. Then the frequency and presence penalties, as OpenAI defines them:
       logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, where c[j] counts
       how often token j was generated so far in this call (the prompt does not count).
       Penalties apply to greedy decoding too: that is where loops happen.
    2. temperature 0: the argmax of the penalized logits (the filters below cannot change it).
    3. probabilities of logits / temperature; then top-k (the k most probable), min-p (those
       with probability >= min_p x the most probable one's), top-p (the smallest prefix of
       the rest, most probable first, whose mass reaches top_p); renormalize and draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from strata.errors import ConfigError

STOCK_REPEAT_WINDOW = 64  # tokens of history the penalty sees (llama.cpp's repeat_last_n default)
OPENAI_PENALTY_RANGE = (-2.0, 2.0)  # frequency_penalty and presence_penalty, as OpenAI bounds them


@dataclass(frozen=True)
class SamplerConfig:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    seed: int = 0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_window: int = STOCK_REPEAT_WINDOW
    frequency_penalty: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature: must be a finite number >= 0 (0: greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # NaN fails this too
            raise ConfigError(f"top_p: must be in (0, 1] (1: off), got {self.top_p}")
        if self.seed < 0:
            raise ConfigError(f"seed: must be >= 0, got {self.seed}")
        if self.top_k < 0:
            raise ConfigError(f"top_k: must be >= 0 (0: off), got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ConfigError(f"min_p: must be in [0, 1) (0: off), got {self.min_p}")
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            raise ConfigError(f"repeat_penalty: must be a finite number > 0 (1: off), got {self.repeat_penalty}")
        if self.repeat_window < 1:
            raise ConfigError(f"repeat_window: must be >= 1, got {self.repeat_window}")
        lo, hi = OPENAI_PENALTY_RANGE
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not lo <= value <= hi:  # NaN fails this too
                raise ConfigError(f"{name}: must be in [{lo:g}, {hi:g}] (0: off), got {value}")

    @property
    def penalized(self) -> bool:
        """Whether a step's logits depend on the tokens so far (any penalty on)."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return (z - np.log(np.exp(z).sum(axis=-1, keepdims=True))).astype(np.float32)


def penalize(logits: np.ndarray, history: Sequence[int], penalty: float, window: int) -> np.ndarray:
    """The logits [vocab] with the repetition penalty applied to the tokens among the last
    `window` of `history` (each once, however often it occurs). A new array; penalty 1: a copy."""
    out = np.array(logits, dtype=np.float32)
    if penalty == 1.0 or not len(history):
        return out
    seen = np.unique(np.asarray(history[-window:], dtype=np.int64))
    seen = seen[(seen >= 0) & (seen < out.shape[-1])]
    z = out[seen]
    out[seen] = np.where(z > 0, z / np.float32(penalty), z * np.float32(penalty))
    return out


def penalize_counts(logits: np.ndarray, generated: Sequence[int], frequency: float, presence: float) -> np.ndarray:
    """OpenAI's frequency and presence penalties: logit[j] - c[j] * frequency - (c[j] > 0) * presence,
    c[j] the count of token j in `generated`. A new array; both 0: a copy.

    Shapes: logits [V] -> float32 [V]
    """
    out = np.array(logits, dtype=np.float32)
    if (frequency == 0.0 and presence == 0.0) or not len(generated):
        return out
    ids = np.asarray(generated, dtype=np.int64)
    ids = ids[(ids >= 0) & (ids < out.shape[-1])]
    counts = np.bincount(ids, minlength=out.shape[-1])[: out.shape[-1]].astype(np.float64)  # [V]
    out -= (counts * frequency + (counts > 0) * presence).astype(np.float32)
    return out


def penalized(logits: np.ndarray, cfg: SamplerConfig, history: Sequence[int], generated: Sequence[int]) -> np.ndarray:
    """Step 1 of the module docstring: every penalty of `cfg` on the raw logits [V]."""
    out = penalize(logits, history, cfg.repeat_penalty, cfg.repeat_window)
    return penalize_counts(out, generated, cfg.frequency_penalty, cfg.presence_penalty)


def probabilities(logits: np.ndarray, cfg: SamplerConfig, history: Sequence[int] = (),
                  generated: Sequence[int] = ()) -> np.ndarray:
    """The distribution `sample` draws from, over the whole vocabulary (greedy: a point mass on
    the argmax). What speculative sampling accepts against. `history` and `generated` as `sample`.

    Shapes: logits [V] -> float64 [V], summing to 1
    """
    logits = penalized(logits, cfg, history, generated)
    out = np.zeros(logits.shape[-1], np.float64)
    if cfg.temperature == 0.0:
        out[int(np.argmax(logits))] = 1.0
        return out
    order, kept = filtered_probs(logits, cfg)
    out[order] = kept
    return out


def filtered_probs(logits: np.ndarray, cfg: SamplerConfig) -> tuple[np.ndarray, np.ndarray]:
    """The candidates of a sampled step and their renormalized probabilities, most probable first.

    Shapes: logits [vocab] (already penalized) -> (token ids [n], probabilities [n]), n >= 1.
    """
    probs = np.exp(log_softmax(np.asarray(logits, np.float32) / np.float32(cfg.temperature)).astype(np.float64))
    order = np.argsort(-probs, kind="stable")
    if cfg.top_k:
        order = order[: cfg.top_k]
    if cfg.min_p > 0.0:
        p = probs[order]
        order = order[p >= cfg.min_p * p[0]]  # p[0] is the most probable: it always stays
    if cfg.top_p < 1.0:
        cumulative = np.cumsum(probs[order])
        if len(order) < len(probs):  # the nucleus of what top-k / min-p kept, renormalized
            cumulative /= cumulative[-1]
        keep = int(np.searchsorted(cumulative, cfg.top_p) + 1)  # smallest prefix with mass >= top_p
        order = order[:keep]
    kept = probs[order]
    return order, kept / kept.sum()


def sample(logits: np.ndarray, cfg: SamplerConfig, step: int, history: Sequence[int] = (),
           generated: Sequence[int] = ()) -> int:
    """Pick the next token from one position's logits [vocab]; `history` is the token ids so far
    (prompt and generated, oldest first), which only the repetition penalty reads; `generated`
    the ids this call generated so far, which only the frequency and presence penalties read.

    The random draw for step n comes from a generator seeded with (seed, n), so the token at a
    step depends only on the reference engine, the step, the history and the logits: no hidden generator state.
    """
    logits = penalized(logits, cfg, history, generated)
    if cfg.temperature == 0.0:
        return int(np.argmax(logits))
    order, kept = filtered_probs(logits, cfg)
    rng = np.random.default_rng([cfg.seed, step])
    return int(order[rng.choice(len(order), p=kept)])
