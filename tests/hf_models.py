"""Tiny Hugging Face checkpoints for the convert tests.

- `cached_checkpoint(arch, tmp_path_factory)`: the checked-in checkpoint of `arch`
  (tests/fixtures/hf/<arch>/, a session copy) and what transformers computed on it
  (tests/hf_fixtures.py): the suite needs no torch.
- `build_checkpoint(arch, dir)`: how those checkpoints are made, with transformers and torch
  (scripts/make_hf_fixtures.py runs it): a random model of each supported architecture built
  from a config and written with `save_pretrained` (so the files are exactly what transformers
  writes), plus a tiny BPE tokenizer trained here with `tokenizers` and a ChatML-style chat
  template.
- `write_synthetic_checkpoint(dir, ...)`: a larger Qwen3-MoE checkpoint written directly as
  BF16 safetensors (no torch, streamed to disk) for the memory and interruption tests.

The tiny models are trained for TRAIN_STEPS steps on CORPUS before saving (~1 s each). A
random model's next-token distribution is nearly flat, so the top two logits are often closer
than any quantization noise and "same argmax" would measure luck; a model that has learned
its text predicts it with margins like a real model's, which is what the q8_0 argmax and the
greedy comparisons are about. PARITY_TEXT (the corpus) is what the tests evaluate on.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

ARCHS = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "minimax_m2")
TOKENIZER_VOCAB = 320  # 256 bytes + 3 special tokens + merges
MODEL_VOCAB = 336  # real checkpoints pad the embedding past the tokenizer; so do these
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
INIT_STD = 0.15  # transformers' 0.02 makes every logit and router score nearly equal
TRAIN_STEPS = 20
TRAIN_LR = 1e-2
HIDDEN, LAYERS, HEADS, KV_HEADS, EXPERTS, TOP_K, EXPERT_FFN = 64, 2, 4, 2, 8, 2, 64
MAX_POSITIONS = 512

CHAT_TEMPLATE = """{%- for message in messages %}
    {%- if message['role'] == 'system' %}
<|im_start|>system
{{ message['content'] }}<|im_end|>
    {%- else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
    {%- endif %}

{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CORPUS = [
    "the quick brown fox jumps over the lazy dog; def main(): return 0",
    "naïve café über straße — 日本語のテキスト, emoji 🙂 and tabs\tand   spaces",
    "Mixture of experts models route each token to a few experts out of many.",
]
PARITY_TEXT = " ".join(CORPUS)

_SIGMOID_KW = dict(n_routed_experts=EXPERTS, moe_intermediate_size=EXPERT_FFN, n_group=4, topk_group=2,
                   n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   num_hidden_layers=3, intermediate_size=96)
_MLA_KW = dict(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               num_key_value_heads=HEADS)
SELECTION_BIAS_STD = 0.1  # near the gaps between sigmoid scores: the bias decides some selections

# per architecture: (transformers config class, model class, config overrides)
_ARCH_KW = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=EXPERTS, moe_intermediate_size=EXPERT_FFN, head_dim=32, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=EXPERTS, moe_intermediate_size=EXPERT_FFN, shared_expert_intermediate_size=96,
                       norm_topk_prob=False, tie_word_embeddings=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=EXPERTS, intermediate_size=EXPERT_FFN)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=EXPERTS, intermediate_size=EXPERT_FFN)),
    # the sigmoid-routed families: 4 groups of 2 experts, the best 2 groups eligible, so a group
    # rule applied wrongly changes selections; the selection biases are set after training
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_SIGMOID_KW, **_MLA_KW)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(_SIGMOID_KW, head_dim=16, use_qk_norm=True, attention_bias=True)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(_SIGMOID_KW, **_MLA_KW)),
    # DeepSeek-V3 with YaRN (its released configs' rope): built by tests/hf_deepseek_yarn.py
    "deepseek_v3_yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_SIGMOID_KW, **_MLA_KW, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0})),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(num_local_experts=EXPERTS, intermediate_size=EXPERT_FFN, head_dim=16, rotary_dim=8)),
}
# how each test checkpoint is saved: in bfloat16 (the Hub's usual dtype; half the bytes checked in
# under tests/fixtures) unless a dtype is named here; mixtral in shards
SAVE_DTYPE: dict[str, str] = {}
DEFAULT_SAVE_DTYPE = "bfloat16"
SHARDED = {"mixtral": "150KB"}


def write_tokenizer(directory: Path) -> None:
    """tokenizer.json (a byte-level BPE trained on CORPUS) and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>",
              "bos_token": None, "model_max_length": MAX_POSITIONS, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def hf_config(arch: str, **overrides):
    import transformers

    config_cls, _, kw = _ARCH_KW[arch]
    fields = dict(vocab_size=MODEL_VOCAB, hidden_size=HIDDEN, intermediate_size=EXPERT_FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_experts_per_tok=TOP_K,
                  max_position_embeddings=MAX_POSITIONS, initializer_range=INIT_STD, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    fields.update(kw)
    fields.update(overrides)
    return getattr(transformers, config_cls)(**fields)


def train_briefly(model, ids) -> None:
    """A few AdamW steps of next-token prediction on `ids` [1, T] (see the module doc)."""
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
    for _ in range(TRAIN_STEPS):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build_checkpoint(arch: str, directory: Path, seed: int = 0):
    """Save a trained tiny `arch` model (and the tokenizer) in `directory`; returns the model as
    transformers loads it back, in float32."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    _, model_cls, _ = _ARCH_KW[arch]
    write_tokenizer(directory)
    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(PARITY_TEXT).ids
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(hf_config(arch))
    train_briefly(model, torch.tensor(ids)[None])
    _set_selection_biases(model, seed)
    saved = model.to(getattr(torch, SAVE_DTYPE.get(arch, DEFAULT_SAVE_DTYPE)))
    saved.save_pretrained(directory, max_shard_size=SHARDED.get(arch, "5GB"))
    # the reference: what the saved file holds, in float32
    return getattr(transformers, model_cls).from_pretrained(directory, dtype=torch.float32).eval()


def _set_selection_biases(model, seed: int) -> None:
    """Random e_score_correction_bias buffers (transformers initializes them to zero and
    training leaves them: a zero bias would not test that it chooses but never weights)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * SELECTION_BIAS_STD)


# ---------------------------------------------------------------- a larger synthetic checkpoint


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], fill) -> None:
    """A BF16 safetensors file, written tensor by tensor: fill(name, shape) -> float32 values."""
    header, offset = {}, 0
    for name, shape in tensors:
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in tensors:
            x = np.ascontiguousarray(fill(name, shape), dtype=np.float32)
            f.write((x.view(np.uint32) >> 16).astype("<u2").tobytes())  # truncation to bf16: fine for noise


def write_synthetic_checkpoint(directory: Path, *, layers: int = 4, experts: int = 64, hidden: int = 256,
                               ffn: int = 512, shards: int = 2, vocab: int = MODEL_VOCAB, seed: int = 0,
                               std: float = 0.05) -> int:
    """A Qwen3-MoE checkpoint of random BF16 weights in `shards` files with an index, plus the
    tokenizer; matrices N(0, std), norms 1. Returns the routed experts' size in float32 bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    heads, kv, hd = 4, 2, 64
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": vocab,
              "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": hd, "num_experts": experts, "num_experts_per_tok": 4,
              "moe_intermediate_size": ffn, "intermediate_size": ffn, "rms_norm_eps": 1e-6,
              "rope_theta": 1e6, "rope_scaling": None, "max_position_embeddings": 4096, "norm_topk_prob": True,
              "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    dense = [("model.embed_tokens.weight", (vocab, hidden)), ("model.norm.weight", (hidden,)),
             ("lm_head.weight", (vocab, hidden))]
    per_layer: list[list[tuple[str, tuple[int, ...]]]] = []
    for l in range(layers):
        p = f"model.layers.{l}."
        t = [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
             (p + "self_attn.q_proj.weight", (heads * hd, hidden)), (p + "self_attn.k_proj.weight", (kv * hd, hidden)),
             (p + "self_attn.v_proj.weight", (kv * hd, hidden)), (p + "self_attn.o_proj.weight", (hidden, heads * hd)),
             (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
             (p + "mlp.gate.weight", (experts, hidden))]
        for e in range(experts):
            q = p + f"mlp.experts.{e}."
            t += [(q + "gate_proj.weight", (ffn, hidden)), (q + "up_proj.weight", (ffn, hidden)),
                  (q + "down_proj.weight", (hidden, ffn))]
        per_layer.append(t)
    rng = np.random.default_rng(seed)
    fill = lambda name, shape: (np.ones(shape, np.float32) if len(shape) == 1  # noqa: E731
                                else rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
    per = max(1, layers // shards)
    groups = [sum(per_layer[i: i + per], []) for i in range(0, layers, per)]
    groups[0] = dense + groups[0]
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        _write_safetensors(directory / name, group, fill)
        weight_map.update({t: name for t, _ in group})
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    write_tokenizer(directory)
    return layers * experts * 3 * ffn * hidden * 4


def cached_checkpoint(arch: str, tmp_path_factory):
    """(checkpoint dir, hf_fixtures.Expected) for `arch`: a session copy of the checked-in
    checkpoint and what transformers computed on it, shared by every convert test module."""
    from tests import hf_fixtures

    return hf_fixtures.cached_checkpoint(arch, tmp_path_factory)
