"""Tiny gpt-oss checkpoints, built offline like tests/hf_models.py builds the other families: a
random `GptOssForCausalLM` from a config, trained briefly on the corpus (so that "same argmax"
measures conversion, not luck), in two forms:

- `bf16`: saved by `save_pretrained` in bfloat16 (float experts: `gate_up_proj` [E, D, 2F]
  interleaved, `down_proj` [E, F, D], their biases);
- `mxfp4`: the same model with its experts as the released checkpoints store them
  (`*_blocks` / `*_scales`, `quantization_config.quant_method = "mxfp4"`), quantized here by
  strata's reference MXFP4 rule (mx.quantize's) and the dense tensors in bfloat16; the reference
  model is what transformers itself loads from it (`Mxfp4Config(dequantize=True)`: its own
  dequantization of the blocks).

Two layers (sliding, then full attention: transformers' default order), a window of 16 (the
131-position parity text is longer), YaRN with factor 8 over an original context of 64, and a
SwiGLU limit of 1.5 instead of 7 so that the clamps are active on these small activations.

The forms are fixtures like the other families' (tests/hf_fixtures.py): `ARCHS` names them,
`build_checkpoint(arch, directory)` trains the model with a fixed seed (the same model for both)
and saves one form, and the tests read the checked-in checkpoint and transformers' outputs on it
through `cached_checkpoint(form, tmp_path_factory)`: no torch at test time.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests import hf_models
from tests.hf_models import EXPERT_FFN, EXPERTS, HEADS, HIDDEN, INIT_STD, KV_HEADS, MAX_POSITIONS, MODEL_VOCAB, TOP_K

FORMS = ("bf16", "mxfp4")
LAYERS = 2
HEAD_DIM = 32
WINDOW = 16
SWIGLU_LIMIT = 1.5
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
# the released checkpoints' list (transformers reads it; strata has no use for it)
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def arch_of(form: str) -> str:
    """The fixture name of one form: tests/fixtures/hf/gpt_oss_<form>/."""
    return f"gpt_oss_{form}"


ARCHS = tuple(arch_of(form) for form in FORMS)


def hf_config(arch: str = arch_of("bf16")):
    """The config of `arch`: the MXFP4 form's adds the quantization_config it is saved with."""
    import transformers

    extra = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
             } if arch == arch_of("mxfp4") else {}
    return transformers.GptOssConfig(
        vocab_size=MODEL_VOCAB, hidden_size=HIDDEN, intermediate_size=EXPERT_FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, sliding_window=WINDOW, max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD, rms_norm_eps=1e-5, swiglu_limit=SWIGLU_LIMIT, rope_parameters=dict(YARN),
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None, **extra)


def mxfp4_planes(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stacked [E, rows, cols] float weights -> (blocks uint8 [E, rows, cols/32, 16], scales uint8 [E, rows, cols/32])."""
    from strata.formats.quant_types import QuantType
    from strata.reference.mlx_quants import quantize

    blocks, scales = [], []
    for m in w:
        q = quantize(QuantType.MXFP4, m)
        blocks.append(q.codes.reshape(m.shape[0], -1, 16))
        scales.append(q.scales)
    return np.ascontiguousarray(np.stack(blocks)), np.ascontiguousarray(np.stack(scales))


def write_mxfp4(model, config: dict, directory: Path) -> None:
    """The model's weights in the released layout: experts as MXFP4 blocks, the rest bfloat16;
    `config` is the float checkpoint's config.json (what save_pretrained wrote)."""
    import torch
    from safetensors.torch import save_file

    out = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_planes(t.detach().transpose(1, 2).float().numpy())  # rows: output channels
            out[name + "_blocks"], out[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
        else:
            out[name] = t.detach().to(torch.bfloat16).contiguous()
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = dict(config, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED})
    (directory / "config.json").write_text(json.dumps(config, indent=1))


def build_checkpoint(arch: str, directory: Path, seed: int = 0):
    """Save the trained tiny model (and the tokenizer) in `directory` in the form `arch` names;
    returns it as transformers loads it back in float32 (the MXFP4 form: with transformers' own
    dequantization of the blocks, tests/hf_reference.load_model)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from tests import hf_reference

    hf_models.write_tokenizer(directory)
    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(hf_models.PARITY_TEXT).ids
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(hf_config())
    hf_models.train_briefly(model, torch.tensor(ids)[None])
    model.to(torch.bfloat16).save_pretrained(directory)
    if arch == arch_of("mxfp4"):  # the same weights, experts requantized: replaces the float file
        write_mxfp4(model, json.loads((directory / "config.json").read_text()), directory)
    return hf_reference.load_model(directory)


def cached_checkpoint(form: str, tmp_path_factory):
    """(checkpoint dir, hf_fixtures.Expected) of one form: a session copy of the checked-in
    checkpoint and what transformers computed on it."""
    from tests import hf_fixtures

    return hf_fixtures.cached_checkpoint(arch_of(form), tmp_path_factory)
