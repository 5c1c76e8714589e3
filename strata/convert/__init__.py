"""Hugging Face MoE checkpoints (safetensors + config.json + tokenizer.json) -> strata's
`name.gguf` + `name.experts`, streamed tensor by tensor. One module per architecture family
(qwen_moe, olmoe, mixtral), the shared tensor map (common), config reading (hf_config), the
shard reader (safetensors_reader), the tokenizer files, what is checked before writing
(checkpoint_plan) and the driver; a llama.cpp GGUF read for a run in place, nothing written
(gguf_in_place). docs/convert.md."""

from strata.convert.architectures import FAMILIES, family_for
from strata.convert.driver import ConvertResult, convert, output_paths

__all__ = ["FAMILIES", "ConvertResult", "convert", "family_for", "output_paths"]
