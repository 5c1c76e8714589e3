"""Tiny Qwen4-Exp checkpoints drawn at random over the family's configuration space, for the
randomized parity test (tests/reference/test_qwen4_random_parity.py); checked in under tests/fixtures/hf/
with transformers' outputs by scripts/make_hf_fixtures.py, like tests/hf_qwen4.py's two.

Each fixture `qwen4_exp_random_<seed>` draws, from random.Random(seed): the text-only or the
multimodal class; the stream count and the mixer's rank; 3 to 5 layers, their kinds from
`full_attention_interval` or an explicit list (at least one indexed attention layer); which
DeltaNet layers carry PLE (at least one); the rotary fraction, the multimodal rotary sections and
their interleaving, rope_theta; attention and DeltaNet head counts and widths; the indexer's
heads, width, block and budget; the n-gram size, heads per order, table base, divisor, hash seed
and the number of row shards the tables are saved in; the conv kernels; the eos id (the parity
text's most frequent token, another token, or a list whose first entry counts); experts, top-k,
norm_topk_prob, tied embeddings; from seed GATE_DRAWN_FROM on, the DeltaNet's output gate
(`output_gate_type` unset, "silu" or "sigmoid", from its own random stream so the other draws
stay those of the earlier seeds, whose fixtures predate the key and leave it unset). Every parameter transformers initializes to a constant (the
zero-centred norms, the DeltaNet's gated norm, dt_bias, the PLE conv) gets noise; then the model
trains briefly (hf_models.train_briefly) so its argmax is not luck, and is saved in BF16.

The indexer has 8 or 16 heads: with 4, a block whose every head scores <= 0 ties at 0 often, and
transformers' torch.topk breaks ties in no defined order (docs/qwen4.md); the parity test checks
that no tie decides a selection in these fixtures.
"""

from __future__ import annotations

import random
from pathlib import Path

from tests import hf_models, hf_qwen4

SEEDS = (6, 7, 9, 14, 17, 24, 27)
GATE_DRAWN_FROM = 20  # the first seed whose output_gate_type is drawn (the earlier ones leave it unset: silu)
PREFIX = "qwen4_exp_random_"
ARCHS = tuple(f"{PREFIX}{s}" for s in SEEDS)
CONSTANT_NOISE_STD = 0.3  # the spread given to constant-initialized parameters (norm weights near 0 or 1)


def seed_of(arch: str) -> int:
    return int(arch.removeprefix(PREFIX))


def _sections(r: random.Random, half_rotary: int) -> list[int]:
    """Three positive multimodal rotary sections summing to the rotary half-width."""
    a = r.randint(1, half_rotary - 2)
    b = r.randint(1, half_rotary - a - 1)
    return [a, b, half_rotary - a - b]


def output_gate_type(seed: int) -> str | None:
    """The DeltaNet's output gate of fixture `seed`: None (transformers' hidden_act, silu), "silu"
    or "sigmoid" (the released checkpoint's), from a stream of its own."""
    if seed < GATE_DRAWN_FROM:
        return None
    return random.Random(seed * 104_729).choice([None, "silu", "sigmoid"])


def text_fields(seed: int) -> dict:
    """The text config's keys for `seed` (the module doc lists what is drawn)."""
    r = random.Random(seed)
    layers = r.randint(3, 5)
    if r.random() < 0.5:  # every interval-th layer indexed (interval <= 3 <= layers: at least one)
        interval = r.choice([2, 3])
        kinds = ["linear_attention" if (i + 1) % interval else "indexed_attention" for i in range(layers)]
        layer_keys = {"full_attention_interval": interval}
    else:  # an explicit list, spelled as the published config spells it, with both kinds
        kinds = [r.choice(["linear_attention", "full_attention"]) for _ in range(layers)]
        full, lin = r.sample(range(layers), 2)
        kinds[full], kinds[lin] = "full_attention", "linear_attention"
        layer_keys = {"layer_types": kinds}
    linear = [i + 1 for i, k in enumerate(kinds) if k == "linear_attention"]
    ple = sorted(r.sample(linear, r.randint(1, len(linear))))
    head_dim = r.choice([32, 64])
    partial = r.choice([0.25, 0.5, 1.0])
    rotary = int(head_dim * partial)
    rope = {"rope_type": "default", "rope_theta": r.choice([10000.0, 1_000_000.0]), "partial_rotary_factor": partial,
            "mrope_section": _sections(r, rotary // 2), "mrope_interleaved": r.choice([True, False])}
    block = r.choice([2, 3, 4])
    ngram = r.choice([2, 3, 4])
    per_order = r.choice([1, 2, 3])
    heads = r.choice([2, 4])
    ids = hf_qwen4._parity_ids()
    eos = r.choice([hf_qwen4.ple_eos(ids), ids[r.randrange(len(ids))]])
    if r.random() < 0.3:
        eos = [eos, r.randrange(hf_models.MODEL_VOCAB)]
    linear_k = r.choice([1, 2])
    fields = hf_qwen4._text_fields(0)
    fields.pop("eos_token_id")
    fields.update(
        num_hidden_layers=layers, ple_layer_ids=ple, head_dim=head_dim, rope_parameters=rope,
        hc_count=r.choice([2, 3, 4]), hc_lowrank=r.choice([8, 16]),
        num_attention_heads=heads, num_key_value_heads=r.choice([h for h in (1, 2, 4) if heads % h == 0]),
        linear_num_key_heads=linear_k, linear_num_value_heads=linear_k * r.choice([1, 2]),
        linear_key_head_dim=r.choice([8, 16]), linear_value_head_dim=r.choice([8, 16]),
        linear_conv_kernel_dim=r.choice([2, 3, 4]),
        indexer_n_heads=r.choice([8, 16]), indexer_head_dim=max(rotary, r.choice([16, 32])),
        indexer_compress_ratio=block, indexer_budget=block * r.choice([1, 2, 3]),
        ngram_size=ngram, heads_per_ngram=per_order, ple_embed_dim=(ngram - 1) * per_order * r.choice([4, 8]),
        ngram_vocab_size_base=r.choice([53, 101, 211]), make_ngram_vocab_size_divisible_by=r.choice([1, 8, 16]),
        split_ngram_parts=r.choice([1, 2, 3]), seed=r.randrange(100_000), ple_conv_kernel_size=r.choice([2, 3, 4]),
        eos_token_id=eos, num_experts=r.choice([4, 6]), num_experts_per_tok=r.choice([1, 2, 3]),
        moe_intermediate_size=r.choice([16, 32]), shared_expert_intermediate_size=r.choice([16, 32]),
        norm_topk_prob=r.choice([True, False]), tie_word_embeddings=r.random() < 0.3, **layer_keys)
    if output_gate_type(seed) is not None:
        fields["output_gate_type"] = output_gate_type(seed)
    return fields


def is_multimodal(seed: int) -> bool:
    return random.Random(seed * 7919).random() < 0.3


def hf_config(arch: str, **text_overrides):
    """The config of fixture `arch` (text_overrides: keys of the text config replaced, for the sweep
    in scripts/qwen4_parity_sweep.py)."""
    import transformers

    seed = seed_of(arch)
    text = {**text_fields(seed), **text_overrides}
    if not is_multimodal(seed):
        return transformers.Qwen4ExpTextConfig(**text)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    return transformers.Qwen4ExpConfig(text_config=text, vision_config=vision,
                                       tie_word_embeddings=text["tie_word_embeddings"])


def perturb_constant_parameters(model, seed: int) -> list[str]:
    """Normal noise (CONSTANT_NOISE_STD) on every parameter whose values are all equal: what
    transformers initializes to a constant, which a checkpoint never holds -> their names."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    names = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.flatten()
            if flat.numel() > 1 and bool((flat == flat[0]).all()):
                p.add_(torch.randn(p.shape, generator=gen) * CONSTANT_NOISE_STD)
                names.append(name)
    return names


def build_checkpoint(arch: str, directory: Path, *, train: bool = True, **text_overrides):
    """Save the trained tiny model of `arch` and the tokenizer in `directory`; returns the model as
    transformers loads it back, in float32 (train False: as initialized and noised, for the sweep)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    seed = seed_of(arch)
    hf_models.write_tokenizer(directory)
    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(hf_models.PARITY_TEXT).ids
    torch.manual_seed(seed)
    cls = getattr(transformers, hf_qwen4.MODEL_CLASS["qwen4_exp" if is_multimodal(seed) else "qwen4_exp_text"])
    model = cls(hf_config(arch, **text_overrides))
    perturb_constant_parameters(model, seed)
    if train:
        hf_models.train_briefly(model, torch.tensor(ids)[None])
    model.to(getattr(torch, hf_qwen4.SAVE_DTYPE)).save_pretrained(directory)
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


def cached_checkpoint(arch: str, tmp_path_factory):
    """(checkpoint dir, hf_fixtures.Expected) for `arch` (a session copy of the checked-in one)."""
    from tests import hf_fixtures

    return hf_fixtures.cached_checkpoint(arch, tmp_path_factory)
