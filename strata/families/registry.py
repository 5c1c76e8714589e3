"""Every family with a module of its own (docs/adding-a-family.md), in the order `ModelConfig`
runs their checks (a config with fields of several reports the first family's error).

Families without one yet (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, GLM-4.5, MiniMax-M2) use only the
fields every family shares and the shared routing rules; their converters are in strata/convert/.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.families import deepseek, gpt_oss, qwen4_exp, qwen_hybrid
from strata.families.family import FamilyParts
from strata.families.deepseek import LatentAttentionConfig, SigmoidRoutingConfig
from strata.families.gpt_oss import GptOssConfig, YarnConfig
from strata.families.qwen4_exp import Qwen4Config
from strata.families.qwen_hybrid import DeltaNetConfig


@dataclass(frozen=True, kw_only=True)
class FamilyFields:
    """Each family's own config fields: one frozen dataclass per family (defined in its module),
    at its "not this family" defaults. `ModelConfig` inherits these attributes
    (`cfg.gpt_oss.sliding_window`) and keeps only the fields every family shares; in the GGUF
    metadata every field is one flat key `strata.<field>` (`ModelConfig.to_dict`), so a field's
    name is unique across the families. A new family with fields of its own adds its attribute here
    (last: the stored keys keep their order, the order the files were first written in)."""

    qwen4: Qwen4Config = field(default_factory=Qwen4Config)  # first: its keys followed the shared ones
    deltanet: DeltaNetConfig = field(default_factory=DeltaNetConfig)
    sigmoid: SigmoidRoutingConfig = field(default_factory=SigmoidRoutingConfig)
    mla: LatentAttentionConfig = field(default_factory=LatentAttentionConfig)
    gpt_oss: GptOssConfig = field(default_factory=GptOssConfig)
    yarn: YarnConfig = field(default_factory=YarnConfig)


FAMILIES: tuple[FamilyParts, ...] = (qwen_hybrid.FAMILY, deepseek.FAMILY, gpt_oss.FAMILY, qwen4_exp.FAMILY)


def published_counter(model_type: str, *, by_prefix: bool = True):
    """The family counter of a config strata refuses, by model_type (exact first, then, with
    by_prefix, the first family type it starts with), or None."""
    for exact in (True, False) if by_prefix else (True,):
        for family in FAMILIES:
            for t in family.published_types:
                if family.count_published and (model_type == t if exact else model_type.startswith(t)):
                    return family.count_published
    return None
