"""A tiny Qwen4-Exp checkpoint of the released Qwen3.8-Flash-Next's form (`qwen4_exp_released`),
checked in under tests/fixtures/hf/ by scripts/make_hf_fixtures.py with transformers' outputs:
what the released config says where it differs from tests/hf_qwen4.py's fixtures, at tiny sizes.

- the DeltaNet's `output_gate_type: "sigmoid"`;
- one PLE layer, `ple_layer_ids: [2]` (transformers' one-indexed: layer 1), its table saved in
  `split_ngram_parts` row shards (3 here; 128 in the release) beside the hash buffers;
- `layer_types` spelled as the release spells them in config.json (`full_attention` for the
  indexed layer; transformers' save_pretrained writes `indexed_attention`, rewritten);
- the shapes llama.cpp's `qwen4exp` loader takes (so tests/gguf_qwen4exp.py can write its GGUF):
  key and value heads of one width (dk = dv = 16, 2 key heads of 2 value heads each: llama.cpp
  tiles those), `ple_embed_dim` = hidden (its ple_key / ple_value are [hc D, D] / [D, D]),
  `norm_topk_prob` true (its graph normalizes the top-k weights, fixed), an integer eos id;
- n-gram rows of 32 values, so the table can be stored in a 32-value block type (Q8_0, IQ4_NL: the
  UD files' table types).

Every parameter transformers initializes to a constant gets noise and the model trains briefly,
as tests/hf_qwen4_random.py does, then is saved in BF16.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests import hf_models, hf_qwen4, hf_qwen4_random

ARCHS = ("qwen4_exp_released",)
SEED = 38
PLE_LAYER_IDS = [2]
NGRAM_SHARDS = 3
HEADS_PER_NGRAM = 1  # 3-grams: 2 heads, rows of 32 (ple_embed_dim 64 / 2): whole Q8_0 / IQ4_NL blocks
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def text_fields() -> dict:
    fields = hf_qwen4._text_fields(hf_qwen4.ple_eos(hf_qwen4._parity_ids()))
    fields.update(layer_types=LAYER_TYPES, ple_layer_ids=PLE_LAYER_IDS, split_ngram_parts=NGRAM_SHARDS,
                  ple_embed_dim=hf_models.HIDDEN, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, output_gate_type="sigmoid",
                  norm_topk_prob=True, heads_per_ngram=HEADS_PER_NGRAM)
    return fields


def hf_config(arch: str = ARCHS[0]):
    import transformers

    return transformers.Qwen4ExpTextConfig(**text_fields())


def build_checkpoint(arch: str, directory: Path):
    """Save the trained tiny model and the tokenizer in `directory`; returns the model as
    transformers loads it back, in float32."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    hf_models.write_tokenizer(directory)
    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(hf_models.PARITY_TEXT).ids
    torch.manual_seed(SEED)
    cls = getattr(transformers, hf_qwen4.MODEL_CLASS["qwen4_exp_text"])
    model = cls(hf_config(arch))
    hf_qwen4_random.perturb_constant_parameters(model, SEED)
    hf_models.train_briefly(model, torch.tensor(ids)[None])
    model.to(getattr(torch, hf_qwen4.SAVE_DTYPE)).save_pretrained(directory)
    _spell_as_released(directory / "config.json")
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


def _spell_as_released(path: Path) -> None:
    """transformers saves the indexed layers as `indexed_attention`; the released config.json says
    `full_attention` (which transformers reads as indexed, and llama.cpp's converter gives a
    compress ratio): written back as released."""
    config = json.loads(path.read_text())
    config["layer_types"] = LAYER_TYPES
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def cached_checkpoint(arch: str, tmp_path_factory):
    """(checkpoint dir, hf_fixtures.Expected) for `arch` (a session copy of the checked-in one)."""
    from tests import hf_fixtures

    return hf_fixtures.cached_checkpoint(arch, tmp_path_factory)
