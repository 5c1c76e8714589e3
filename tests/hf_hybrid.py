"""Tiny Hugging Face checkpoints of the hybrid families (Qwen3-Next, Qwen3.5-MoE text-only and
its published multimodal layout), built like tests/hf_models.py builds the others (and, like
them, checked in under tests/fixtures/hf/ by scripts/make_hf_fixtures.py): a random model from
a config, trained for a few steps on the corpus (so that "same argmax" measures conversion, not
luck), saved in bfloat16 with `save_pretrained`.

Four layers: three gated DeltaNet layers, then one gated full-attention layer (transformers'
`full_attention_interval` 4, as the real checkpoints), head_dim 32 with a quarter of it rotary
(8 dims, `partial_rotary_factor` 0.25 as the real ones), 2 key and 4 value heads of 16 in the
DeltaNet layers (each key head serving two value heads), conv kernel 4, 8 experts top-2 with a
gated shared expert. transformers falls back to its torch code for the conv and the delta rule
when causal-conv1d / flash-linear-attention are not installed (they are not, here).
"""

from __future__ import annotations

from pathlib import Path

from tests import hf_models
from tests.hf_models import EXPERT_FFN, EXPERTS, HEADS, HIDDEN, INIT_STD, KV_HEADS, MAX_POSITIONS, MODEL_VOCAB, TOP_K

ARCHS = ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
LAYERS = 4
HEAD_DIM = 32
PARTIAL_ROTARY = 0.25
MROPE_SECTION = [2, 1, 1]  # sums to rotary_dim / 2 = 4, as [11, 11, 10] does for the real 64
SHARED_FFN = 96
SAVE_DTYPE = "bfloat16"  # the Hub's; half the bytes checked in under tests/fixtures


def _text_fields(**extra) -> dict:
    fields = dict(vocab_size=MODEL_VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                  moe_intermediate_size=EXPERT_FFN, shared_expert_intermediate_size=SHARED_FFN,
                  linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=MAX_POSITIONS,
                  initializer_range=INIT_STD, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    fields.update(extra)
    return fields


def hf_config(arch: str):
    import transformers

    if arch == "qwen3_next":
        return transformers.Qwen3NextConfig(**_text_fields(norm_topk_prob=True, intermediate_size=EXPERT_FFN,
                                                           partial_rotary_factor=PARTIAL_ROTARY))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": PARTIAL_ROTARY,
            "mrope_section": MROPE_SECTION, "mrope_interleaved": True}
    text = _text_fields(rope_parameters=rope)
    if arch == "qwen3_5_moe_text":
        return transformers.Qwen3_5MoeTextConfig(**text)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


MODEL_CLASS = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
               "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def build_checkpoint(arch: str, directory: Path, seed: int = 0, *, text_model=None):
    """Save a trained tiny `arch` model and the tokenizer in `directory`; returns the model as
    transformers loads it back, in float32.

    The multimodal layout is given the language weights of `text_model` (a trained
    qwen3_5_moe_text model; by default the one saved beside `directory`) and a random vision
    tower: the same language model in the other layout, so the two conversions are held to the
    same numbers (and no second training run)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    hf_models.write_tokenizer(directory)
    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(hf_models.PARITY_TEXT).ids
    torch.manual_seed(seed)
    cls = getattr(transformers, MODEL_CLASS[arch])
    model = cls(hf_config(arch))
    if arch == "qwen3_5_moe":
        if text_model is None:
            text_cls = getattr(transformers, MODEL_CLASS["qwen3_5_moe_text"])
            text_model = text_cls.from_pretrained(directory.parent / "qwen3_5_moe_text", dtype=torch.float32)
        model.model.language_model.load_state_dict(text_model.model.state_dict())
        model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    else:
        hf_models.train_briefly(model, torch.tensor(ids)[None])
    model.to(getattr(torch, SAVE_DTYPE)).save_pretrained(directory)
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


def cached_checkpoint(arch: str, tmp_path_factory):
    """(checkpoint dir, hf_fixtures.Expected) for `arch`: a session copy of the checked-in
    checkpoint and what transformers computed on it."""
    from tests import hf_fixtures

    return hf_fixtures.cached_checkpoint(arch, tmp_path_factory)
