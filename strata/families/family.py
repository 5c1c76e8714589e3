"""What a model family provides, one `FamilyParts` in its module (strata/families/<family>.py).

The registry (registry.py) lists them; `ModelConfig` runs every family's `check`, strata doctor
counts a config strata refuses through its family's `count_published`, and the made test models
(strata/testing/models.py `SHAPES`) are the families' `made_shapes`. docs/adding-a-family.md says
which files a new family touches, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from strata.families.counts import PartCounts

if TYPE_CHECKING:  # annotations only: model_config runs the families' checks
    from strata.model_config import ModelConfig

# the made models' vocabulary: 256 bytes + <|endoftext|> (the byte-level tokenizer of testing/models.py)
MADE_VOCAB = 257


@dataclass(frozen=True)
class FamilyParts:
    """One family. model_types: the config.json `model_type` values its converter takes (the
    converter, with the Hugging Face tensor names it maps, is the module `converter` names);
    check(cfg): its fields' rules, one ConfigError naming the field (a config of another family
    passes: its fields are at their defaults); made_shapes: name -> the ModelConfig fields of its
    made test models (architecture and vocab are testing/models.py's); count_published(raw,
    model_type): its weights by part for strata doctor where strata refuses the config, for the
    model types that start with one of `published_types` (None: every config of the family is
    counted through strata's own definitions).
    Hooks for files as stored, unset until a reader takes them: gguf_architectures (GGUF
    `general.architecture` values) and mlx_model_types (mlx-lm's `model_type` values)."""

    name: str
    model_types: tuple[str, ...]
    converter: str
    check: Callable[["ModelConfig"], None]
    made_shapes: Mapping[str, Mapping[str, object]]
    count_published: Callable[[dict, str], PartCounts] | None = None
    published_types: tuple[str, ...] = field(default=())
    gguf_architectures: tuple[str, ...] = field(default=())
    mlx_model_types: tuple[str, ...] = field(default=())
