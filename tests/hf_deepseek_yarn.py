"""The DeepSeek-V3 fixture with YaRN rotary scaling (tests/fixtures/hf/deepseek_v3_yarn/): the
tiny deepseek_v3 checkpoint of tests/hf_models.py with `rope_parameters` of type yarn (factor 4
over an original context of 64 positions, mscale 1 and mscale_all_dim 0.8, so that the cos/sin
attention factor and the softmax's mscale^2 both differ from 1), parity-tested in
tests/convert/test_convert_deepseek_yarn.py. Built by `python scripts/make_hf_fixtures.py deepseek_v3_yarn`.
"""

from __future__ import annotations

from tests import hf_models

ARCHS = ("deepseek_v3_yarn",)
build_checkpoint = hf_models.build_checkpoint
hf_config = hf_models.hf_config
