"""Tiny MLX-quantized checkpoints made by mlx-lm's own `convert` from tests/hf_models.py's
trained checkpoints, and mlx-lm's forward on them (the ground truth for MLX input).

mlx-lm 0.32 reads the transformers-4 spellings of a config (`rope_theta`, Qwen3-MoE's
`num_experts`), so the transformers-5 checkpoint is copied with those keys added first."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

# name -> (architecture, mlx-lm convert arguments)
RECIPES = {
    "qwen3_a4g64_bf16": ("qwen3_moe", dict(q_bits=4, q_group_size=64, dtype="bfloat16")),
    "qwen3_a8g32_f16": ("qwen3_moe", dict(q_bits=8, q_group_size=32, dtype="float16")),
    "qwen3_mxfp4": ("qwen3_moe", dict(q_mode="mxfp4", q_bits=4, q_group_size=32, dtype="bfloat16")),
    "mixtral_a4g32_bf16": ("mixtral", dict(q_bits=4, q_group_size=32, dtype="bfloat16")),
}


def mlx_lm_ready(hf_dir: Path, out: Path) -> Path:
    """A copy of a transformers-5 checkpoint whose config.json mlx-lm 0.32 reads."""
    shutil.copytree(hf_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    if "num_local_experts" in cfg:
        cfg.setdefault("num_experts", cfg["num_local_experts"])
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def quantize_with_mlx_lm(hf_dir: Path, work: Path, recipe: str, quant_predicate=None) -> Path:
    """mlx-lm's `convert(..., quantize=True)` of the checkpoint under `recipe`; -> its directory."""
    from mlx_lm import convert

    _, kw = RECIPES[recipe]
    src = mlx_lm_ready(hf_dir, work / "src")
    out = work / "mlx"
    convert(str(src), mlx_path=str(out), quantize=True, quant_predicate=quant_predicate, **kw)
    return out


def load_float32(mlx_dir: Path):
    """mlx-lm's model of `mlx_dir` with every float parameter (norms, scales, biases) widened to
    float32: the same weight values (the widening is exact), float32 activations."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load

    model, _ = load(str(mlx_dir))
    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a,
                          model.parameters()))
    return model


def mlx_lm_logits(model, tokens: np.ndarray) -> np.ndarray:
    """[T] -> [T, vocab] float32"""
    import mlx.core as mx

    return np.array(model(mx.array(tokens)[None]).astype(mx.float32))[0]


def mlx_lm_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """mlx-lm's own greedy decode (generate_step's default sampler is argmax), with its KV cache."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=steps):
        out.append(int(token))
    return out
