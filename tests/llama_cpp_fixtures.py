"""The GGUF files under tests/fixtures/llama_cpp/, written by llama.cpp itself: its own
`convert_hf_to_gguf.py` on the repo's tiny checkpoints, then its `llama-quantize` with per-tensor
overrides to mixes like unsloth's dynamic (UD) recipes. `scripts/make_llama_cpp_fixtures.py`
makes them from these cases (it needs a llama.cpp build; the tests do not); docs/testing.md has
the exact commands. `dequantized_gguf` writes the reference side of their parity tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FIXTURE_ROOT = Path(__file__).resolve().parent / "fixtures" / "llama_cpp"


@dataclass(frozen=True)
class LlamaCppCase:
    """One fixture: `source` is a checked-in trained checkpoint (tests/fixtures/hf/<source>) or
    "wide" (hf_models.write_synthetic_checkpoint with `wide`'s arguments: rows of 256 weights, which
    K- and IQ-quants need); `config_extra` keys added to its config.json before converting;
    llama-quantize's base type and its `--tensor-type` (regex, type) overrides, first match wins;
    `expected` the ggml type names the file must then hold for (tensor, type) pairs; `added_tokens`
    special tokens given ids after the tokenizer's last (inside the config's vocab_size), for a
    converter that looks them up by name; `config_json_only` runs the converter as it runs where
    transformers does not know the architecture (its own fallback: config.json read as written)."""

    name: str
    source: str
    base_type: str
    tensor_types: tuple[tuple[str, str], ...]
    expected: tuple[tuple[str, str], ...]
    convert_args: tuple[str, ...] = ()
    config_extra: dict = field(default_factory=dict)
    wide: dict = field(default_factory=dict)
    added_tokens: tuple[str, ...] = ()
    config_json_only: bool = False

    @property
    def path(self) -> Path:
        return FIXTURE_ROOT / f"{self.name}.gguf"

    @property
    def needs_imatrix(self) -> bool:
        return any(t in ("iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m", "iq3_xxs") for _, t in self.tensor_types)


def _experts(layer: int, gate: str, up: str, down: str) -> tuple[tuple[str, str], ...]:
    return ((rf"blk\.{layer}\.ffn_gate_exps", gate), (rf"blk\.{layer}\.ffn_up_exps", up),
            (rf"blk\.{layer}\.ffn_down_exps", down))


def _expect(layer: int, gate: str, up: str, down: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"blk.{layer}.ffn_{p}_exps.weight", t.upper()) for p, t in (("gate", gate), ("up", up), ("down", down)))


_WIDE_LAYERS = (("iq3_s", "iq3_s", "iq4_nl"),   # UD-IQ4_XS: IQ3_S gate/up, IQ4_NL down
                ("iq2_xxs", "q4_k", "q5_1"))    # UD-Q4_K_XL's Q4_K / Q5_1, and an IQ2_XXS gate (imatrix)
_SMALL_LAYERS = (("iq4_nl", "iq4_nl", "q5_1"), ("q5_0", "q4_1", "q8_0"))  # rows of 64: 32-blocks only

CASES = (
    # hidden 256, head_dim 64, expert ffn 32 (downs of 32-weight rows, as UD's Q5_1 / IQ4_NL downs);
    # dense by llama.cpp's own Q4_K_M mixture rules (Q4_K, Q5_K, Q8_0 k/v, a Q6_K head), one layer's
    # attn_q IQ4_XS
    LlamaCppCase("qwen3moe_wide-ud", "wide", "Q4_K",
                 sum((_experts(l, *t) for l, t in enumerate(_WIDE_LAYERS)), ()) + ((r"blk\.1\.attn_q", "iq4_xs"),),
                 sum((_expect(l, *t) for l, t in enumerate(_WIDE_LAYERS)), ())
                 + (("blk.0.attn_q.weight", "Q4_K"), ("blk.1.attn_q.weight", "IQ4_XS"), ("blk.0.attn_v.weight", "Q8_0"),
                    ("output.weight", "Q6_K")),
                 wide={"layers": 2, "experts": 8, "hidden": 256, "ffn": 32, "shards": 1, "seed": 0, "std": 0.15}),
    LlamaCppCase("qwen3moe-ud", "qwen3_moe", "Q8_0",
                 sum((_experts(l, *t) for l, t in enumerate(_SMALL_LAYERS)), ()),
                 sum((_expect(l, *t) for l, t in enumerate(_SMALL_LAYERS)), ()) + (("blk.0.attn_q.weight", "Q8_0"),)),
    # DeepSeek-V3's released config.json names its sigmoid scores; the tiny fixture's (transformers
    # 5 drops the key) does not, and llama.cpp then writes no gating key and reads softmax
    LlamaCppCase("deepseek2-ud", "deepseek_v3", "Q8_0",
                 _experts(1, "iq4_nl", "iq4_nl", "q5_1") + _experts(2, "q4_0", "q4_0", "q8_0"),
                 _expect(1, "iq4_nl", "iq4_nl", "q5_1") + _expect(2, "q4_0", "q4_0", "q8_0"),
                 config_extra={"scoring_func": "sigmoid", "topk_method": "noaux_tc"}),
    # gpt-oss's released MXFP4 experts, kept as MXFP4 by the converter and by llama-quantize
    LlamaCppCase("gpt-oss-mxfp4", "gpt_oss_mxfp4", "Q8_0", ((r"ffn_.*_exps", "mxfp4"),),
                 _expect(0, "mxfp4", "mxfp4", "mxfp4") + (("blk.0.attn_q.weight", "Q8_0"),)),
    LlamaCppCase("qwen3next-ud", "qwen3_next", "Q5_0",
                 _experts(0, "iq4_nl", "iq4_nl", "q5_1") + _experts(1, "q4_0", "q4_0", "q8_0"),
                 _expect(0, "iq4_nl", "iq4_nl", "q5_1") + _expect(1, "q4_0", "q4_0", "q8_0")
                 + (("blk.3.attn_q.weight", "Q5_0"),),
                 convert_args=("--no-mtp",)),
    LlamaCppCase("qwen2moe-ud", "qwen2_moe", "Q8_0",
                 _experts(0, "iq4_nl", "iq4_nl", "q5_1") + _experts(1, "q4_0", "q4_0", "q8_0"),
                 _expect(0, "iq4_nl", "iq4_nl", "q5_1") + _expect(1, "q4_0", "q4_0", "q8_0")
                 + (("blk.0.ffn_gate_shexp.weight", "Q8_0"),)),
    LlamaCppCase("olmoe-ud", "olmoe", "Q8_0",
                 sum((_experts(l, *t) for l, t in enumerate(_SMALL_LAYERS)), ()),
                 sum((_expect(l, *t) for l, t in enumerate(_SMALL_LAYERS)), ()) + (("blk.0.attn_q.weight", "Q8_0"),)),
    LlamaCppCase("minimax-m2-ud", "minimax_m2", "Q8_0",
                 _experts(0, "iq4_nl", "iq4_nl", "q5_1") + _experts(1, "q5_0", "q5_0", "q8_0"),
                 _expect(0, "iq4_nl", "iq4_nl", "q5_1") + _expect(1, "q5_0", "q5_0", "q8_0")),
    # llama.cpp's GLM vocabulary reads GLM's own special tokens by name ([gMASK] is its BOS)
    LlamaCppCase("glm4moe-ud", "glm4_moe", "Q8_0",
                 _experts(1, "iq4_nl", "iq4_nl", "q5_1") + _experts(2, "q4_1", "q4_1", "q8_0"),
                 _expect(1, "iq4_nl", "iq4_nl", "q5_1") + _expect(2, "q4_1", "q4_1", "q8_0"),
                 convert_args=("--no-mtp",), added_tokens=("[gMASK]", "<|user|>", "<|observation|>")),
    # layers 1-2's experts IQ4_NL (every projection), to keep the file small
    LlamaCppCase("qwen35moe-ud", "qwen3_5_moe_text", "Q8_0",
                 _experts(0, "iq4_nl", "iq4_nl", "q5_1") + _experts(3, "q4_0", "q4_0", "q8_0")
                 + ((r"blk\.[12]\.ffn_.*_exps", "iq4_nl"),),
                 _expect(0, "iq4_nl", "iq4_nl", "q5_1") + _expect(3, "q4_0", "q4_0", "q8_0")
                 + _expect(1, "iq4_nl", "iq4_nl", "iq4_nl") + (("blk.0.attn_qkv.weight", "Q8_0"),),
                 convert_args=("--no-mtp",)),
    # the released config.json spells the indexed layer `full_attention`, and the converter writes
    # its compress ratio only for that spelling; transformers (5.x) rewrites it to
    # `indexed_attention` when it knows Qwen4-Exp, and the converter then writes ratio 0 (dense
    # attention) everywhere, which strata refuses: the file as made where transformers does not.
    # Layers 1-2's experts IQ4_NL (every projection), to keep the file small
    LlamaCppCase("qwen4exp-ud", "qwen4_exp_released", "Q8_0",
                 _experts(0, "iq4_nl", "iq4_nl", "q5_1") + _experts(3, "q4_0", "q4_0", "q8_0")
                 + ((r"blk\.[12]\.ffn_.*_exps", "iq4_nl"),),
                 _expect(0, "iq4_nl", "iq4_nl", "q5_1") + _expect(3, "q4_0", "q4_0", "q8_0")
                 + _expect(2, "iq4_nl", "iq4_nl", "iq4_nl"),
                 config_json_only=True),
)


def dequantized_gguf(path: Path, out: Path) -> Path:
    """A copy of the GGUF at `path` with every tensor dequantized to F32 by the `gguf` package and
    every metadata key as it was: the reference side ("the forward on gguf's dequantized weights")."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, x.reshape([int(n) for n in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
