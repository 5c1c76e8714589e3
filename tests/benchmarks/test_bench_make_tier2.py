"""benchmarks/make_tier2_checkpoint.py at a tiny size on CPU: the checkpoint is what mlx-lm's
convert writes (4-bit affine g64 per its config, stacked quantized experts, the byte count it
reports), tier 2 runs it with greedy tokens equal to mlx-lm's own generate, and bad requests are
refused in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import make_tier2_checkpoint as maker  # noqa: E402
import strata  # noqa: E402
from strata.generate import generate  # noqa: E402
from tests import tier2_models  # noqa: E402

# the per-layer shape shrunk: every width a multiple of the group size (64)
TINY = {
    "qwen3_next": ["--layers", "4", "--hidden", "128", "--experts", "16", "--moe-hidden", "64", "--top-k", "4",
                   "--vocab", "320", "--set", "num_attention_heads=4", "head_dim=32", "linear_num_value_heads=4",
                   "linear_num_key_heads=2", "linear_key_head_dim=32", "linear_value_head_dim=32",
                   "intermediate_size=128", "shared_expert_intermediate_size=64"],
    "deepseek_v3": ["--layers", "3", "--hidden", "128", "--experts", "16", "--moe-hidden", "64", "--top-k", "4",
                    "--vocab", "320", "--set", "num_attention_heads=4", "num_key_value_heads=4", "q_lora_rank=64",
                    "kv_lora_rank=64", "qk_rope_head_dim=16", "qk_nope_head_dim=32", "v_head_dim=32",
                    "intermediate_size=256"],
}
PROMPT = [5, 17, 99, 200, 3, 45, 77, 12]


@pytest.mark.parametrize("family", maker.FAMILIES)
def test_made_checkpoint_runs_on_tier2_as_on_mlx_lm(family, tmp_path, capsys):
    out = tmp_path / family
    assert maker.main([family, "--out", str(out), "--quiet", *TINY[family]]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    assert config["model_type"] == family and config["hidden_size"] == 128
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert summary["bytes"] == index["metadata"]["total_size"]
    assert summary["moe_layers"] == (4 if family == "qwen3_next" else 2)  # DeepSeek-V3's first layer is dense
    assert any(k.endswith("switch_mlp.down_proj.scales") for k in index["weight_map"])  # quantized, stacked
    want = tier2_models.mlx_lm_generate(out, PROMPT, 4)
    with strata.load(out) as model:
        assert model.tensors.n_experts == 16 and model.cfg.n_experts_per_token == 4
        assert {p.dtype for p in model.tensors.pieces if p.name.endswith(".weight")} == {"uint32"}
        assert generate(model, PROMPT, max_tokens=4).tokens == want


@pytest.mark.parametrize("args, says", [
    (["deepseek_v3", "--experts", "60"], "multiple of 8"),
    (["qwen3_next", "--top-k", "600"], "--top-k 600"),
    (["qwen3_next", "--set", "no_such_field=1"], "no_such_field"),
    (["qwen3_next", "--hidden", "100"], "multiple of --group-size 64"),
])
def test_bad_requests_refused_in_one_line(args, says, tmp_path, capsys):
    assert maker.main([*args, "--out", str(tmp_path / "m"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err
    assert not (tmp_path / "m").exists()


def test_a_non_empty_directory_is_refused(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert maker.main(["qwen3_next", "--out", str(tmp_path), "--quiet", *TINY["qwen3_next"]]) == 2
    assert "not empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_a_mixed_recipe_is_convert_s_own(tmp_path, capsys):
    """`--recipe mixed_4_6`: convert's own predicate, so some layers' experts in 6 bits (the
    config records each module's), and tier 2 still gives mlx-lm's tokens."""
    out = tmp_path / "mixed"
    assert maker.main(["qwen3_next", "--out", str(out), "--quiet", "--recipe", "mixed_4_6", *TINY["qwen3_next"]]) == 0
    quant = json.loads((out / "config.json").read_text())["quantization"]
    down = {k: v["bits"] for k, v in quant.items() if k.endswith("switch_mlp.down_proj")}
    assert sorted(set(down.values())) == [4, 6]
    with strata.load(out) as model:
        assert len(model.tensors.formats) == 2
        assert generate(model, PROMPT, max_tokens=4).tokens == tier2_models.mlx_lm_generate(out, PROMPT, 4)
