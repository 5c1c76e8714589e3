"""A model file's dense tensors widened as the loader used to hold them (float32 at load, through
gguf's own dequantize): the weights every engine computed with before dense weights were held
as stored (tests/formats/test_formats_dense_weights.py, tests/mlx_backend/test_mlx_dense.py compare against them)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from strata.formats.gguf_file import open_gguf


def widened_file_tensors(model_path: Path) -> tuple[int, dict[str, np.ndarray]]:
    """(the dense bytes the file stores, name -> its tensor widened to float32 in its shape)."""
    gf = open_gguf(model_path)
    try:
        total, widened = 0, {}
        for name, info in gf.tensors.items():
            total += int(info.nbytes)
            x = gguf.quants.dequantize(gf.raw(info), gguf.GGMLQuantizationType(info.ggml_type))
            widened[name] = np.array(x, np.float32).reshape(info.shape)
        return total, widened
    finally:
        gf.close()
