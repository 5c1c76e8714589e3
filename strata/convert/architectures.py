"""The architecture families `strata convert` supports, by config.json `model_type`."""

from __future__ import annotations

from strata.convert.common import Family
from strata.convert.deepseek import DEEPSEEK_V3, GLM4_MOE_LITE
from strata.convert.glm_moe import GLM4_MOE
from strata.convert.minimax import MINIMAX_M2
from strata.convert.gpt_oss import GPT_OSS
from strata.convert.hf_config import HFConfig
from strata.convert.mixtral import MIXTRAL
from strata.convert.olmoe import OLMOE
from strata.convert.qwen_hybrid import QWEN3_5_MOE, QWEN3_NEXT
from strata.convert.qwen4_exp import QWEN4_EXP
from strata.convert.qwen_moe import QWEN2_MOE, QWEN3_MOE
from strata.errors import ConfigError

FAMILIES: tuple[Family, ...] = (QWEN3_MOE, QWEN2_MOE, OLMOE, MIXTRAL, QWEN3_NEXT, QWEN3_5_MOE,
                                DEEPSEEK_V3, GLM4_MOE_LITE, GLM4_MOE, MINIMAX_M2, GPT_OSS, QWEN4_EXP)
BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}


def supported_list() -> str:
    return ", ".join(f"{t} ({f.name})" for t, f in BY_MODEL_TYPE.items())


def family_for(hf: HFConfig) -> Family:
    """The family of a config, or a ConfigError listing the supported model types."""
    t = hf.model_type
    if t not in BY_MODEL_TYPE:
        what = f"unknown model_type {t!r}" if t is not None else "no model_type"
        raise ConfigError(f"{hf.path}: {what}; supported: {supported_list()}")
    return BY_MODEL_TYPE[t]
