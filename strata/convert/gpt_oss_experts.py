"""gpt-oss's routed experts as a Hugging Face checkpoint stores them, in either form:

- float (what transformers' `save_pretrained` writes, and the BF16 re-uploads):
  `{L}.mlp.experts.gate_up_proj` [E, D, 2F] applied as x @ W, its columns interleaved (column
  2i is gate row i, 2i + 1 up row i), `down_proj` [E, F, D]; biases `gate_up_proj_bias` [E, 2F]
  (interleaved the same way) and `down_proj_bias` [E, D];
- MXFP4 (the released checkpoints: config `quantization_config.quant_method = "mxfp4"`):
  `gate_up_proj_blocks` [E, 2F, D/32, 16] and `gate_up_proj_scales` [E, 2F, D/32] (uint8),
  `down_proj_blocks` [E, D, F/32, 16], `down_proj_scales` [E, D, F/32], biases as above.
  Row r of a projection is output channel r; within a block, byte j holds weight 2j in its low
  nibble and 2j + 1 in its high one; a scale byte is e8m0 (2^(s - 127)). That is strata's MXFP4
  exactly (strata/formats/mxfp4.py; transformers' `convert_moe_packed_tensors` dequantizes the
  same way): the planes are kept bit for bit, gate rows = even rows, up rows = odd rows.
"""

from __future__ import annotations

import numpy as np

from strata.convert.safetensors_reader import Checkpoint
from strata.errors import FormatError
from strata.formats.expert_record import ExpertBiases, ExpertWeights
from strata.formats.mxfp4 import BLOCK
from strata.formats.quant_matrix import QuantMatrix
from strata.formats.quant_types import QuantType
from strata.model_config import ModelConfig
from strata.reference.mlx_quants import dequantize

LAYER = "model.layers.{}.mlp.experts."
BLOCK_BYTES = BLOCK // 2  # 16 bytes of e2m1 codes per 32 weights


class GptOssExpertTensors:
    """Reads expert (layer, e): `read` as float32 gate [F, D], up [F, D], down [D, F];
    `read_quantized` as its MXFP4 planes (qtype MXFP4 only); `read_biases` its biases.
    Checks every name, shape and dtype at construction."""

    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, mxfp4: bool) -> None:
        self._ckpt, self._cfg = ckpt, cfg
        self.qtype = QuantType.MXFP4 if mxfp4 else None  # kept bit for bit unless --experts is given
        e, f, d = cfg.n_experts, cfg.expert_ffn_size, cfg.hidden_size
        if mxfp4:
            want = {"gate_up_proj_blocks": ((e, 2 * f, d // BLOCK, BLOCK_BYTES), "U8"),
                    "gate_up_proj_scales": ((e, 2 * f, d // BLOCK), "U8"),
                    "down_proj_blocks": ((e, d, f // BLOCK, BLOCK_BYTES), "U8"),
                    "down_proj_scales": ((e, d, f // BLOCK), "U8")}
        else:
            want = {"gate_up_proj": ((e, d, 2 * f), None), "down_proj": ((e, f, d), None)}
        want.update({"gate_up_proj_bias": ((e, 2 * f), None), "down_proj_bias": ((e, d), None)})
        self.consumed: set[str] = set()
        for layer in range(cfg.n_layers):
            for suffix, (shape, dtype) in want.items():
                self._check(LAYER.format(layer) + suffix, shape, dtype)

    def _check(self, name: str, shape: tuple[int, ...], dtype: str | None) -> None:
        ck = self._ckpt
        if name not in ck:
            raise FormatError(f"{ck.directory}: checkpoint has no tensor {name} (gpt-oss routed experts)")
        if ck.shape(name) != shape:
            raise FormatError(f"{ck.directory}: tensor {name}: shape {list(ck.shape(name))}, expected {list(shape)}")
        if dtype is None:
            ck.check_dtype(name)
        elif ck.info(name).dtype != dtype:
            raise FormatError(f"{ck.directory}: tensor {name} has dtype {ck.info(name).dtype}, expected {dtype}")
        self.consumed.add(name)

    def _matrix(self, layer: int, proj: str, e: int) -> QuantMatrix:
        base = LAYER.format(layer) + proj
        blocks = self._ckpt.read_raw(base + "_blocks", np.dtype(np.uint8), e)  # [R, C/32, 16]
        scales = self._ckpt.read_raw(base + "_scales", np.dtype(np.uint8), e)  # [R, C/32]
        rows, n_blocks = scales.shape
        return QuantMatrix(QuantType.MXFP4, rows, n_blocks * BLOCK, blocks.reshape(rows, n_blocks * BLOCK_BYTES),
                           scales)

    def read_quantized(self, layer: int, e: int) -> ExpertWeights:
        """The expert's MXFP4 planes as stored (gate = even rows of gate_up, up = odd rows)."""
        gu, down = self._matrix(layer, "gate_up_proj", e), self._matrix(layer, "down_proj", e)
        f = self._cfg.expert_ffn_size
        half = lambda r: QuantMatrix(QuantType.MXFP4, f, gu.n_cols, np.ascontiguousarray(gu.codes[r::2]),  # noqa: E731
                                     np.ascontiguousarray(gu.scales[r::2]))
        return ExpertWeights(half(0), half(1), down)

    def read(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Shapes: -> gate [F, D], up [F, D], down [D, F] float32"""
        if self.qtype is QuantType.MXFP4:
            w = self.read_quantized(layer, e)
            return dequantize(w.gate), dequantize(w.up), dequantize(w.down)
        gu = self._ckpt.read(LAYER.format(layer) + "gate_up_proj", e)  # [D, 2F]
        down = self._ckpt.read(LAYER.format(layer) + "down_proj", e)  # [F, D]
        return np.ascontiguousarray(gu[:, 0::2].T), np.ascontiguousarray(gu[:, 1::2].T), np.ascontiguousarray(down.T)

    def read_biases(self, layer: int, e: int) -> ExpertBiases:
        gu = self._ckpt.read(LAYER.format(layer) + "gate_up_proj_bias", e)  # [2F]
        down = self._ckpt.read(LAYER.format(layer) + "down_proj_bias", e)  # [D]
        return ExpertBiases(np.ascontiguousarray(gu[0::2]), np.ascontiguousarray(gu[1::2]), np.ascontiguousarray(down))
