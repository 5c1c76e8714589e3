"""What `strata.generate` reads of a Model, for an engine built from made parameters
(`strata.testing.mlx_params.random_params`: no files, so no strata.loader.Model): the config and
a byte-level tokenizer (ids 0..255 the bytes, 256 end-of-text; larger ids decode to nothing).
Tests and benchmarks hand it to `MlxEngine(params, model=...)` to run `stream_generate` on it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata.model_config import ModelConfig
from strata.tokenizer import Tokenizer, byte_level_tokenizer_json

__all__ = ["StandInModel", "stand_in_model"]

BYTE_EOS = 256  # the byte-level tokenizer's <|endoftext|>


@dataclass(frozen=True)
class StandInModel:
    cfg: ModelConfig
    tokenizer: Tokenizer


def stand_in_model(cfg: ModelConfig, *, eos: frozenset[int] | set[int] = frozenset({BYTE_EOS})) -> StandInModel:
    """eos: the ids that end a generation (empty: only max_tokens and the context do; a random
    model's greedy tokens may hit 256 at any step)."""
    tok = Tokenizer.from_json(byte_level_tokenizer_json())
    return StandInModel(cfg, replace(tok, eos_ids=frozenset(eos)))
