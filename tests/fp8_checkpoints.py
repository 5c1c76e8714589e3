"""FP8 checkpoints in the published layout, made offline from a float checkpoint (tests/convert/test_convert_fp8.py).

`write_fp8_checkpoint` quantizes a checkpoint's linear weights the way transformers'
`Fp8Quantize` (and DeepSeek's `fp8_cast`) do: per block of `block` [bn, bk] (ragged at the
right and bottom edges), amax over the block, `scale = 448 / amax`, codes = e4m3fn(clamp(w *
scale, -448, 448)) rounded to nearest even (ml_dtypes' cast), and `weight_scale_inv = 1 / scale`
in float32; config.json gets `quantization_config: {quant_method: fp8, fmt: e4m3,
activation_scheme: dynamic, weight_block_size: block}`. `write_dequantized` writes the same
model with those weights decoded back (ml_dtypes' e4m3fn -> float32, times the block's scale in
float32), in F32 or BF16: the model the FP8 checkpoint stands for, made without strata's decoder.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from strata.convert.safetensors_reader import Checkpoint

FP8_MAX = 448.0
PUBLISHED_BLOCK = (128, 128)  # DeepSeek-V3's, Qwen's, MiniMax's weight_block_size
NOT_QUANTIZED = ("embed_tokens", "lm_head", "conv1d", "mlp.gate.weight", "block_sparse_moe.gate.weight")
FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # transformers 5's [E, rows, cols] tensors


def quantized_names(ckpt: Checkpoint) -> list[str]:
    """The tensors a published FP8 checkpoint stores as e4m3 blocks: its linear weights (every
    2-D `.weight` but the embeddings, the head and the routers, which stay in float, as in
    DeepSeek's and Qwen's `modules_to_not_convert`) and fused expert stacks; here also the
    n-gram tables, which transformers' FP8Embedding can hold."""
    out = []
    for name, info in ckpt.tensors.items():
        if info.dtype not in ("BF16", "F16", "F32") or any(k in name for k in NOT_QUANTIZED):
            continue
        if (len(info.shape) == 2 and name.endswith(".weight")) or name.endswith(FUSED_EXPERTS):
            out.append(name)
    return sorted(out)


def quantize_blocks(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [..., N, K], scale_inv float32 [..., ceil(N/bn), ceil(K/bk)]) of float32 w [..., N, K]."""
    (bn, bk), (n, k) = block, w.shape[-2:]
    gn, gk = -(-n // bn), -(-k // bk)
    codes = np.empty(w.shape, np.uint8)
    inv = np.empty((*w.shape[:-2], gn, gk), np.float32)
    for i in range(gn):
        for j in range(gk):
            x = w[..., i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            amax = np.abs(x).max(axis=(-2, -1), keepdims=True)
            scale = np.where(amax > 0, np.float32(FP8_MAX) / np.where(amax > 0, amax, 1), 1).astype(np.float32)
            q = np.clip(x * scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
            codes[..., i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = q.view(np.uint8)
            inv[..., i, j] = (np.float32(1) / scale)[..., 0, 0]
    return codes, inv


def dequantize_blocks(codes: np.ndarray, inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 [..., N, K]: ml_dtypes' value of each code times its block's scale (float32)."""
    (bn, bk), (n, k) = block, codes.shape[-2:]
    full = np.repeat(np.repeat(inv, bn, axis=-2), bk, axis=-1)[..., :n, :k]
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * full


def _write(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file of (dtype, shape, raw bytes) per name, written by hand (numpy's
    safetensors writer has no F8_E4M3)."""
    header, offset = {}, 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _, _, raw in tensors.values():
            f.write(raw)


def _copy_beside(src: Path, dst: Path) -> None:
    """Everything of checkpoint `src` but its weights into `dst` (config, tokenizer files)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.suffix != ".npz":
            shutil.copy(f, dst / f.name)


def _raw(ckpt: Checkpoint, name: str) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor as stored: (dtype, shape, bytes)."""
    info = ckpt.info(name)
    with open(info.shard, "rb") as f:
        f.seek(info.begin)
        return info.dtype, info.shape, f.read(info.end - info.begin)


def _edit_config(directory: Path, change) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config, indent=1))


def write_fp8_checkpoint(src: Path, dst: Path, *, block: tuple[int, int] = PUBLISHED_BLOCK,
                         scale_dtype: str = "F32") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`src` with its linear weights in FP8 blocks, at `dst` (one model.safetensors) -> {name:
    (codes, scale_inv float32)} of what was quantized. scale_dtype: F32 (DeepSeek's), BF16 or
    F8_E8M0 (then every scale is first rounded up to a power of two, as `scale_fmt: ue8m0` does)."""
    _copy_beside(src, dst)
    quantized, tensors = {}, {}
    with Checkpoint(src) as ckpt:
        names = set(quantized_names(ckpt))
        for name in ckpt.tensors:
            if name not in names:
                tensors[name] = _raw(ckpt, name)
                continue
            w = ckpt.read(name)
            codes, inv = quantize_blocks(w, block)
            if scale_dtype == "F8_E8M0":
                inv = np.ldexp(np.float32(1), np.ceil(np.log2(inv)).astype(np.int32)).astype(np.float32)
                full = np.repeat(np.repeat(inv, block[0], -2), block[1], -1)[..., :w.shape[-2], :w.shape[-1]]
                codes = np.clip(w / full, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
                stored = (np.log2(inv).astype(np.int32) + 127).astype(np.uint8).tobytes()
            elif scale_dtype == "BF16":
                inv = inv.astype(ml_dtypes.bfloat16).astype(np.float32)
                stored = inv.astype(ml_dtypes.bfloat16).tobytes()
            else:
                stored = inv.tobytes()
            quantized[name] = (codes, inv)
            scale_key = name.removesuffix(".weight") + ".weight_scale_inv" if name.endswith(".weight") \
                else name + "_scale_inv"
            tensors[name] = ("F8_E4M3", w.shape, codes.tobytes())
            tensors[scale_key] = (scale_dtype, inv.shape, stored)
    _write(dst / "model.safetensors", tensors)

    def add(config):
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        if scale_dtype == "F8_E8M0":
            q["scale_fmt"] = "ue8m0"
        config["quantization_config"] = q

    _edit_config(dst, add)
    return quantized


def write_dequantized(src: Path, quantized: dict[str, tuple[np.ndarray, np.ndarray]], dst: Path, *,
                      block: tuple[int, int] = PUBLISHED_BLOCK, dtype: str = "F32") -> None:
    """The float checkpoint the FP8 one stands for: `src` with each quantized weight replaced by
    its dequantized values, stored as `dtype` (F32: exactly; BF16: as transformers' dequantize
    into a bfloat16 model rounds them)."""
    _copy_beside(src, dst)
    tensors = {}
    with Checkpoint(src) as ckpt:
        for name in ckpt.tensors:
            if name not in quantized:
                tensors[name] = _raw(ckpt, name)
                continue
            w = dequantize_blocks(*quantized[name], block)
            raw = w.tobytes() if dtype == "F32" else w.astype(ml_dtypes.bfloat16).tobytes()
            tensors[name] = (dtype, w.shape, raw)
    _write(dst / "model.safetensors", tensors)
