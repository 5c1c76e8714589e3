"""Tiny Hugging Face checkpoints of Qwen4-Exp (text-only `qwen4_exp_text` and the published
multimodal layout `qwen4_exp`), built like tests/hf_hybrid.py builds the hybrids and checked in
under tests/fixtures/hf/ by scripts/make_hf_fixtures.py.

Four layers: three gated DeltaNet layers (PLE modules on the first and third), then one indexed
(QSA) attention layer; 4 hyper-connection streams of width 64 with a rank-16 input mixer.
PLE: 3-grams, 2 heads per order, prime table sizes from 101 (tables of 424 and 512 rows of 8),
conv kernel 4 (dilation 3), saved in 2 row shards per table. QSA: 8 indexer heads of 16 (with
fewer, a block whose every head scores <= 0 ties at 0 often, and a tie is no parity test), key
blocks of 4 positions, a budget of 16 positions (4 blocks): from position 19 on, a query sees
only some of the blocks before it, so the selection decides the output over most of the text.

The config's `eos_token_id` (the token the n-gram shifts stop at) is the parity text's most
frequent token, so the teacher-forced text and the greedy prompt hold it many times; generation
still stops on the tokenizer's end-of-sequence tokens, as for every family. transformers
initializes the PLE conv to zeros; it is drawn at random here so the conv and its state count.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tests import hf_models
from tests.hf_models import EXPERT_FFN, EXPERTS, HEADS, HIDDEN, INIT_STD, KV_HEADS, MAX_POSITIONS, MODEL_VOCAB, TOP_K

ARCHS = ("qwen4_exp_text", "qwen4_exp")
LAYERS = 4
HEAD_DIM = 32
PARTIAL_ROTARY = 0.25
MROPE_SECTION = [2, 1, 1]
SHARED_FFN = 96
HC_COUNT, HC_LOWRANK = 4, 16
PLE_LAYER_IDS = [1, 3]  # transformers' one-indexed ids: layers 0 and 2
NGRAM_SIZE, HEADS_PER_NGRAM, NGRAM_VOCAB_BASE, NGRAM_DIVISOR, PLE_EMBED = 3, 2, 101, 8, 32
NGRAM_SHARDS = 2
INDEXER_HEADS, INDEXER_HEAD_DIM, INDEXER_BUDGET, INDEXER_BLOCK = 8, 16, 16, 4
PLE_CONV_STD = 0.5
SAVE_DTYPE = "bfloat16"


def ple_eos(ids: list[int]) -> int:
    """The most frequent token of the parity text (the smallest id among equals)."""
    counts = Counter(ids)
    return min(counts, key=lambda t: (-counts[t], t))


def _text_fields(eos: int) -> dict:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": PARTIAL_ROTARY,
            "mrope_section": MROPE_SECTION, "mrope_interleaved": True}
    return dict(vocab_size=MODEL_VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                moe_intermediate_size=EXPERT_FFN, shared_expert_intermediate_size=SHARED_FFN,
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=MAX_POSITIONS,
                initializer_range=INIT_STD, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=rope,
                hc_count=HC_COUNT, hc_lowrank=HC_LOWRANK, ple_layer_ids=PLE_LAYER_IDS, ple_embed_dim=PLE_EMBED,
                ple_conv_kernel_size=4, ngram_size=NGRAM_SIZE, heads_per_ngram=HEADS_PER_NGRAM,
                ngram_vocab_size_base=NGRAM_VOCAB_BASE, make_ngram_vocab_size_divisible_by=NGRAM_DIVISOR,
                split_ngram_parts=NGRAM_SHARDS, indexer_n_heads=INDEXER_HEADS, indexer_kv_heads=1,
                indexer_head_dim=INDEXER_HEAD_DIM, indexer_budget=INDEXER_BUDGET,
                indexer_compress_ratio=INDEXER_BLOCK, eos_token_id=eos, bos_token_id=None, pad_token_id=None)


def _parity_ids() -> list[int]:
    import tempfile

    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        hf_models.write_tokenizer(Path(tmp))
        return Tokenizer.from_file(str(Path(tmp) / "tokenizer.json")).encode(hf_models.PARITY_TEXT).ids


def hf_config(arch: str, eos: int | None = None):
    import transformers

    text = _text_fields(ple_eos(_parity_ids()) if eos is None else eos)
    if arch == "qwen4_exp_text":
        return transformers.Qwen4ExpTextConfig(**text)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    return transformers.Qwen4ExpConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


MODEL_CLASS = {"qwen4_exp_text": "Qwen4ExpForCausalLM", "qwen4_exp": "Qwen4ExpForConditionalGeneration"}


def _randomize_ple_convs(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        if layer.ple is not None:
            with torch.no_grad():
                layer.ple.conv1d.weight.copy_(torch.randn(layer.ple.conv1d.weight.shape, generator=gen) * PLE_CONV_STD)


def build_checkpoint(arch: str, directory: Path, seed: int = 0, *, text_model=None):
    """Save a trained tiny `arch` model and the tokenizer in `directory`; returns the model as
    transformers loads it back, in float32. The multimodal layout gets the language weights of
    the text model saved beside `directory` (or `text_model`) and a random vision tower."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    hf_models.write_tokenizer(directory)
    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(hf_models.PARITY_TEXT).ids
    torch.manual_seed(seed)
    cls = getattr(transformers, MODEL_CLASS[arch])
    model = cls(hf_config(arch, ple_eos(ids)))
    if arch == "qwen4_exp":
        if text_model is None:  # the one just built beside it, else the checked-in one
            from tests import hf_fixtures

            sibling = directory.parent / "qwen4_exp_text"
            source = sibling if sibling.is_dir() else hf_fixtures.checkpoint_dir("qwen4_exp_text")
            text_cls = getattr(transformers, MODEL_CLASS["qwen4_exp_text"])
            text_model = text_cls.from_pretrained(source, dtype=torch.float32)
        model.model.language_model.load_state_dict(text_model.model.state_dict())
        model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    else:
        _randomize_ple_convs(model, seed)
        hf_models.train_briefly(model, torch.tensor(ids)[None])
    model.to(getattr(torch, SAVE_DTYPE)).save_pretrained(directory)
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


def cached_checkpoint(arch: str, tmp_path_factory):
    """(checkpoint dir, hf_fixtures.Expected) for `arch` (a session copy of the checked-in one)."""
    from tests import hf_fixtures

    return hf_fixtures.cached_checkpoint(arch, tmp_path_factory)
