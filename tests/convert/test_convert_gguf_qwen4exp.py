"""`strata convert` of llama.cpp's `qwen4exp` (Qwen3.8-Flash-Next) GGUF is refused in one line
naming `general.architecture` and why: llama.cpp's graph gates the DeltaNet output with sigmoid
(fixed in its graph, no key in the file), which strata's Qwen4-Exp does not compute, and the file
keeps one n-gram table with stored hash constants where strata derives a table per PLE layer from
the seed (docs/convert.md). The file is written with the metadata keys and global tensors
llama.cpp's converter (conversion/qwen4exp.py) writes for the checked-in Qwen4-Exp checkpoint, so
the refusal is of a file as llama.cpp lays it out, not of a stub."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from strata.cli.main import main
from strata.convert import convert
from strata.errors import ConfigError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen4_exp_text"
ARCH = "qwen4exp"


def _write_qwen4exp_header(path: Path) -> Path:
    """The `qwen4exp.*` keys llama.cpp's converter writes for the fixture's config (its first PLE
    layer only: llama.cpp's loader holds one set of hash constants) and a token embedding."""
    import gguf

    cfg = json.loads((FIXTURE / "config.json").read_text())
    a = ARCH
    w = gguf.GGUFWriter(str(path), a)
    u32 = lambda key, value: w.add_uint32(f"{a}.{key}", int(value))  # noqa: E731
    arr = lambda key, values, kind: w.add_key_value(f"{a}.{key}", [int(v) for v in values],  # noqa: E731
                                                    gguf.GGUFValueType.ARRAY, sub_type=kind)
    U32, U64 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64  # the arrays' types as llama.cpp writes them
    u32("block_count", cfg["num_hidden_layers"])
    u32("context_length", cfg["max_position_embeddings"])
    u32("embedding_length", cfg["hidden_size"])
    u32("attention.head_count", cfg["num_attention_heads"])
    u32("attention.head_count_kv", cfg["num_key_value_heads"])
    u32("attention.key_length", cfg["head_dim"])
    u32("expert_count", cfg["num_experts"])
    u32("expert_used_count", cfg["num_experts_per_tok"])
    u32("expert_feed_forward_length", cfg["moe_intermediate_size"])
    u32("expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"])
    u32("ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    u32("ssm.state_size", cfg["linear_key_head_dim"])
    u32("ssm.group_count", cfg["linear_num_key_heads"])
    u32("ssm.time_step_rank", cfg["linear_num_value_heads"])
    u32("ssm.inner_size", cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"])
    u32("full_attention_interval", 4)
    u32("hyper_connection.count", cfg["hc_count"])
    u32("hyper_connection.low_rank", cfg["hc_lowrank"])
    u32("attention.indexer.head_count", cfg["indexer_n_heads"])
    u32("attention.indexer.key_length", cfg["indexer_head_dim"])
    u32("attention.indexer.top_k", cfg["indexer_budget"])
    ratios = [cfg["indexer_compress_ratio"] if t != "linear_attention" else 0 for t in cfg["layer_types"]]
    arr("attention.compress_ratios", ratios, U32)
    arr("ple.layers", [cfg["ple_layer_ids"][0] - 1], U32)
    u32("ple.ngram_size", cfg["ngram_size"])
    u32("ple.heads_per_ngram", cfg["heads_per_ngram"])
    u32("ple.conv_kernel", cfg["ple_conv_kernel_size"])
    u32("ple.eos_token_id", cfg["eos_token_id"])
    n_heads = (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"]
    u32("embedding_length_per_layer_input", cfg["ple_embed_dim"] // n_heads)
    arr("ple.layer_multipliers", [3, 5, 7], U64)
    arr("ple.head_offsets", [101 * h for h in range(n_heads)], U64)
    arr("ple.head_vocab_sizes", [101] * n_heads, U64)
    w.add_tensor("token_embd.weight", np.zeros((cfg["vocab_size"], cfg["hidden_size"]), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qwen4exp_gguf_is_refused_naming_the_architecture_and_why(tmp_path, capsys):
    path = _write_qwen4exp_header(tmp_path / "qwen4exp.gguf")
    with pytest.raises(ConfigError, match=r"general\.architecture = 'qwen4exp' not supported: .*sigmoid.*"
                                          r"from Hugging Face checkpoints with a silu gate only"):
        convert(path, tmp_path / "out")
    assert main(["convert", str(path), str(tmp_path / "cli"), "--quiet"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "qwen4exp" in err_lines[0] and "internal error" not in err_lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "cli").exists()
