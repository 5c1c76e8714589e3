"""Random blocks of llama.cpp's types for tests: valid bytes (any code byte is valid), scale fields
drawn finite, with edge values (zero, minus zero, subnormal, the largest finite; e8m0 / ue4m3
extremes) mixed in where a test asks for them."""

from __future__ import annotations

import numpy as np

from strata.formats import ggml_blocks
from strata.formats.quant_types import QuantType, ggml_block_name

# float16 scales with edges: zero, minus zero, the smallest subnormal, the largest finite, ones
F16_EDGES = np.array([0.0, -0.0, 2.0**-24, -(2.0**-24), 65504.0, -65504.0, 1.0, -1.0, 6.1e-5], np.float16)
U8_EDGES = np.array([0, 1, 2, 127, 128, 254, 255, 0x7F, 0x7E, 0x80, 0xFF], np.uint8)  # e8m0 / ue4m3 bytes


def random_blocks(qtype: QuantType, n_blocks: int, seed: int, edges: bool = True) -> np.ndarray:
    """n random blocks of a ggml type as raw bytes: every code byte random, every float16 field a
    finite value (with `edges`, half of them drawn from F16_EDGES), every e8m0 / ue4m3 scale byte
    random (with `edges`, U8_EDGES mixed in; without, a range whose values stay finite).
    uint8 [n_blocks * block_bytes]"""
    rng = np.random.default_rng(seed)
    name = ggml_block_name(qtype)
    _, dt = ggml_blocks.BLOCK_DTYPES[name]
    raw = rng.integers(0, 256, n_blocks * dt.itemsize, dtype=np.uint8)
    b = raw.view(dt)
    for field in dt.names:
        if dt[field].base == np.float16:
            vals = rng.standard_normal(b[field].shape).astype(np.float16)
            edge = rng.random(b[field].shape) < (0.5 if edges else 0.0)
            b[field] = np.where(edge, rng.choice(F16_EDGES, b[field].shape), vals)
    if name == "IQ1_M":  # its float16 scale is spread over the top nibbles of 4 u16 words
        words = b["scales"].copy().view("<u2")
        d = np.where(rng.random(n_blocks) < (0.5 if edges else 0.0), rng.choice(F16_EDGES, n_blocks),
                     rng.standard_normal(n_blocks).astype(np.float16)).astype(np.float16).view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        b["scales"] = words.view(np.uint8).reshape(n_blocks, 8)
    if name in ("MXFP4", "NVFP4"):
        field = "e" if name == "MXFP4" else "d"
        if edges:
            edge = rng.random(b[field].shape) < 0.3
            b[field] = np.where(edge, rng.choice(U8_EDGES, b[field].shape), b[field])
        else:  # e8m0 2^(e-128) near 1; ue4m3 below its 0x7F (read as 0) and exponent 15
            b[field] = rng.integers(100, 150, b[field].shape) if name == "MXFP4" else rng.integers(8, 0x70, b[field].shape)
    return raw
