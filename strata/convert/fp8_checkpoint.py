"""A Hugging Face FP8 checkpoint (block-wise e4m3 weights with `weight_scale_inv`) read as the float
checkpoint it stands for.

The form DeepSeek-V3, Kimi, MiniMax and Qwen publish, and transformers' `FineGrainedFP8Config`
reads: config.json has `quantization_config: {quant_method: "fp8", fmt: "e4m3",
activation_scheme: "dynamic", weight_block_size: [128, 128]}`; each quantized linear `p` is
`p.weight` (F8_E4M3, its float shape [N, K], or [E, N, K] for transformers 5's fused experts)
beside `p.weight_scale_inv` (F32, or BF16 / F16, or F8_E8M0 power-of-two bytes when
`scale_fmt` is ue8m0) of shape [ceil(N / bn), ceil(K / bk)] (one per block of the
`weight_block_size` [bn, bk]; the last row and column of blocks are ragged when N or K is not a
multiple), or a scalar without a block size. A fused tensor `p` has `p_scale_inv`. The value is
`weight[i, j] = e4m3(code[i, j]) * scale_inv[i // bn, j // bk]` (the scale is the block's
`amax / 448`: "inverse" of the factor the weights were multiplied by), computed in float32 as
DeepSeek's `weight_dequant` and transformers' `Fp8Dequantize` compute it, so the values equal
theirs bit for bit (transformers then rounds them to the model's dtype; strata keeps float32 and
stores them as --dense / --experts ask). Norms, routers, embeddings and the modules listed in
`modules_to_not_convert` stay in their float dtype and are read as they are.

`Fp8Checkpoint` is a `Checkpoint` whose tensors are the logical ones (no `*_scale_inv`), so the
shared driver and every family's converter read it unchanged. Refused by name: e5m2 weights,
static activation scales, FP4-packed experts, an F8_E4M3 tensor without its scales, and a
scale grid that does not match the weight's shape and block size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint, TensorInfo, bf16_bits_to_f32
from strata.errors import ConfigError, FormatError
from strata.formats.float8 import e4m3fn_to_f32
from strata.formats.mxfp4 import e8m0_to_f32

QUANT_METHOD = "fp8"
FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"  # `p.weight` -> `p.weight_scale_inv`; a fused `p` -> `p_scale_inv`
# the dtypes a block scale may be stored in -> (bytes per element, stored numpy dtype)
SCALE_DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F8_E8M0": np.dtype(np.uint8)}
WEIGHT_FORMATS = ("e4m3", "float8_e4m3fn")  # DeepSeek's and Qwen's spelling; MiniMax's
ACTIVATION_SCHEMES = ("dynamic",)  # activations are quantized at run time by the published inference
SCALE_FORMATS = ("float", "ue8m0")


@dataclass(frozen=True)
class Fp8Quantization:
    """config.json's `quantization_config` of an FP8 checkpoint; block None: one scale per tensor."""

    block: tuple[int, int] | None


def quantization_of(hf: HFConfig) -> Fp8Quantization | None:
    """The FP8 quantization of a checkpoint's config, or None when it is not an FP8 checkpoint (a
    float one, or another method, which the float path refuses by name)."""
    q = hf.raw.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        return None

    def refuse(feature: str, supported: str) -> ConfigError:
        return ConfigError(f"{hf.path}: unsupported FP8 checkpoint: quantization_config.{feature} "
                           f"(supported: {supported})")

    fmt = q.get("fmt", WEIGHT_FORMATS[0])
    if fmt not in WEIGHT_FORMATS:
        raise refuse(f"fmt = {fmt!r}", "e4m3 weights ('e4m3' or 'float8_e4m3fn')")
    scheme = str(q.get("activation_scheme", ACTIVATION_SCHEMES[0])).lower()
    if scheme not in ACTIVATION_SCHEMES:
        raise refuse(f"activation_scheme = {scheme!r}", "'dynamic': weights with block scales, no input scales")
    if q.get("expert_dtype", "fp8") != "fp8":
        raise refuse(f"expert_dtype = {q['expert_dtype']!r}", "FP8 experts")
    if q.get("scale_fmt", SCALE_FORMATS[0]) not in SCALE_FORMATS:
        raise refuse(f"scale_fmt = {q['scale_fmt']!r}", " or ".join(repr(s) for s in SCALE_FORMATS))
    block = q.get("weight_block_size")
    if block is None:
        return Fp8Quantization(None)
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise refuse(f"weight_block_size = {block!r}", "two positive integers, [rows, columns] of a block")
    return Fp8Quantization((block[0], block[1]))


def without_quantization(hf: HFConfig) -> HFConfig:
    """The config without `quantization_config`: the float model the families read."""
    return dataclasses.replace(hf, raw={k: v for k, v in hf.raw.items() if k != "quantization_config"})


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


class Fp8Checkpoint(Checkpoint):
    """A Checkpoint of an FP8 model, seen as its float model (see the module doc)."""

    def __init__(self, directory, quant: Fp8Quantization) -> None:
        super().__init__(directory)
        self.quant = quant
        self.raw_tensors = self.tensors
        self.fp8: dict[str, TensorInfo] = {}  # logical weight name -> its scales' TensorInfo
        for name, info in self.raw_tensors.items():
            if info.dtype == FP8_DTYPE:
                self.fp8[name] = self._check(info)
        if not self.fp8:  # the config and the tensors disagree: which one is wrong is the user's to say
            raise ConfigError(f"{self.directory}: unsupported pre-quantized checkpoint: quantization_config.quant_method "
                              f"= {QUANT_METHOD!r} but no tensor is {FP8_DTYPE} (supported: FP8 weights beside their "
                              "weight_scale_inv, or a float checkpoint without quantization_config)")
        hidden = {scale_name(n) for n in self.fp8}
        self.tensors = {n: i for n, i in self.raw_tensors.items() if n not in hidden}

    def _block(self, name: str) -> tuple[int, int]:
        """[bn, bk] of FP8 weight `name`: the config's, or the whole matrix (one scale per matrix)."""
        return self.quant.block or tuple(self.raw_tensors[name].shape[-2:])

    def _scale_grid(self, name: str) -> tuple[int, ...]:
        """The scales' shape for weight `name` [..., N, K]: [..., ceil(N / bn), ceil(K / bk)]."""
        shape, (bn, bk) = self.raw_tensors[name].shape, self._block(name)
        return (*shape[:-2], _blocks(shape[-2], bn), _blocks(shape[-1], bk))

    def _check(self, info: TensorInfo) -> TensorInfo:
        """The scales of FP8 weight `info`, checked against its shape before anything is read."""
        where = f"{info.shard.name}: tensor {info.name}"
        if info.end - info.begin != int(np.prod(info.shape, dtype=np.int64)):
            raise FormatError(f"{where}: {FP8_DTYPE} {list(info.shape)} needs {int(np.prod(info.shape))} bytes, "
                              f"the header gives {info.end - info.begin}")
        if len(info.shape) < 2:
            raise FormatError(f"{where}: a {len(info.shape)}-D {FP8_DTYPE} tensor where block-quantized matrices "
                              "are expected")
        sname = scale_name(info.name)
        if sname not in self.raw_tensors:
            raise FormatError(f"{where} is {FP8_DTYPE} without its block scales {sname} (only FP8 checkpoints with "
                              "weight_scale_inv are supported)")
        scales = self.raw_tensors[sname]
        if scales.dtype not in SCALE_DTYPES:
            raise FormatError(f"{scales.shard.name}: tensor {sname} has dtype {scales.dtype}; block scales in "
                              f"{', '.join(SCALE_DTYPES)} are supported")
        want = self._scale_grid(info.name)
        # a per-tensor scale may be saved as a scalar, [1] or [E]: the same values up to unit axes
        if [d for d in scales.shape if d != 1] != [d for d in want if d != 1]:
            raise FormatError(f"{scales.shard.name}: tensor {sname}: shape {list(scales.shape)}, expected {list(want)} "
                              f"for {info.name} {list(info.shape)} in blocks of {list(self._block(info.name))}")
        want_bytes = SCALE_DTYPES[scales.dtype].itemsize * int(np.prod(want, dtype=np.int64))
        if scales.end - scales.begin != want_bytes:
            raise FormatError(f"{scales.shard.name}: tensor {sname}: {scales.dtype} {list(scales.shape)} needs "
                              f"{want_bytes} bytes, the header gives {scales.end - scales.begin}")
        return scales

    def check_dtype(self, name: str) -> None:
        if name not in self.fp8:
            super().check_dtype(name)

    def _scales(self, name: str, index: int | None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The block scales of FP8 weight `name` (of `name[index]`; of its rows of blocks
        [rows[0], rows[1]) only, for a 2-D weight) as float32.
        Shapes: -> _scale_grid(name) (without its first axis with index; rows[1] - rows[0] rows)"""
        info = self.fp8[name]
        grid = self._scale_grid(name)
        begin, nbytes = info.begin, info.end - info.begin
        if index is not None:
            grid, nbytes = grid[1:], nbytes // grid[0]
            begin += index * nbytes
        if rows is not None:
            row_bytes = nbytes // grid[0]
            grid, nbytes = (rows[1] - rows[0], grid[1]), (rows[1] - rows[0]) * row_bytes
            begin += rows[0] * row_bytes
        s = np.frombuffer(self._pread(info, begin, nbytes), dtype=SCALE_DTYPES[info.dtype]).reshape(grid)
        if info.dtype == "BF16":
            return bf16_bits_to_f32(s)
        if info.dtype == "F8_E8M0":
            return e8m0_to_f32(s)
        return s.astype(np.float32)

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """Tensor `name` as float32 (an FP8 weight dequantized block by block); with `index`,
        only `tensor[index]` along the first axis.

        Shapes: -> shape(name), or shape(name)[1:] with index
        """
        if name not in self.fp8:
            return super().read(name, index)
        codes = self.read_raw(name, np.dtype(np.uint8), index)
        w = e4m3fn_to_f32(codes)  # a fresh float32 array: the scales are applied in place
        scales = self._scales(name, index)
        (bn, bk), k = self._block(name), w.shape[-1]
        for i in range(scales.shape[-2]):  # one row of blocks at a time: no weight-sized scale array
            row_scales = np.repeat(scales[..., i, :], bk, axis=-1)[..., :k]  # [..., K]
            w[..., i * bn:(i + 1) * bn, :] *= row_scales[..., None, :]
        return w

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of 2-D FP8 weight `name` (an n-gram table) as float32, reading only
        those rows and the rows of block scales they fall in.

        Shapes: -> [stop - start, K]
        """
        info = self.raw_tensors[name]
        (bn, bk), k = self._block(name), info.shape[1]
        codes = np.frombuffer(self._pread(info, info.begin + start * k, (stop - start) * k), np.uint8)
        w = e4m3fn_to_f32(codes.reshape(stop - start, k))
        first = start // bn
        scales = self._scales(name, None, rows=(first, (stop - 1) // bn + 1))  # [blocks spanned, ceil(K / bk)]
        row_scales = np.repeat(scales[np.arange(start, stop) // bn - first], bk, axis=-1)[:, :k]  # [stop - start, K]
        w *= row_scales
        return w
