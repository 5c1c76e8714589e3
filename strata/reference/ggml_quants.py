"""Reference dequantization of llama.cpp's weight blocks (pure numpy), as ggml's
`dequantize_row_*` (ggml-quants.c) defines each type.

Written from ggml's C semantics, one function per type, over the block records of
strata/formats/ggml_blocks.py. Every value is computed in float32 with the operations in C's
order (`d * sc` first, then `* q`, then `- m`: each product rounded on its own, no fused
multiply-add), so the result is ggml's to the bit; tests/reference/test_ggml_quants.py holds each type to
the `gguf` package's dequantizer bit for bit. Notation below: `b` the block records [N],
the result [N, weights per block]; "sub-block" a run of 16 or 32 weights sharing a scale.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from strata.formats import ggml_blocks as gb
from strata.formats.ggml_blocks import IQ1_DELTA, KSIGNS_IQ2XS, KVALUES_IQ4NL, KVALUES_MXFP4, TQ_POW3
from strata.formats.quant_types import QuantType, ggml_block_name

F32 = np.float32


def _f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def _d(b: np.ndarray, field: str = "d") -> np.ndarray:
    """A block's float16 scale in float32, shaped to broadcast over the block's other axes. [N, 1]"""
    return _f32(b[field])[:, None]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-weight nibble order: weight j < 16 the low nibble of byte j, j >= 16 the high
    nibble of byte j - 16. qs [..., 16] -> [..., 32]"""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(x: np.ndarray, n: int = 8) -> np.ndarray:
    """The 8 bits of each byte, LSB first. uint8 [...] -> [..., 8] uint8 (n: 8, the only width)"""
    assert n == 8 and x.dtype == np.uint8
    return np.unpackbits(x[..., None], axis=-1, bitorder="little")


# ---------------------------------------------------------------- 32-weight blocks


def q4_0(b):
    return (_nibbles(b["qs"]).astype(np.int32) - 8).astype(F32) * _d(b)


def q4_1(b):
    return _nibbles(b["qs"]).astype(F32) * _d(b) + _d(b, "m")


def _q5(b) -> np.ndarray:
    """5-bit codes: the nibble, plus bit j of the 32-bit `qh` as bit 4 of weight j. [N, 32]"""
    qh = _bits(b["qh"].reshape(-1, 4), 8).reshape(-1, 32)  # bit j of the little-endian u32
    return _nibbles(b["qs"]).astype(np.int32) | (qh.astype(np.int32) << 4)


def q5_0(b):
    return (_q5(b) - 16).astype(F32) * _d(b)


def q5_1(b):
    return _q5(b).astype(F32) * _d(b) + _d(b, "m")


def q8_0(b):
    return b["qs"].astype(F32) * _d(b)


def iq4_nl(b):
    return _d(b) * KVALUES_IQ4NL[_nibbles(b["qs"])].astype(F32)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """GGML_E8M0_TO_FP32_HALF: 2**(e - 128), exact (e < 2: float32 subnormals)."""
    e = np.asarray(e).astype(np.int32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32), (e - 1).astype(np.uint32) << 23)
    return bits.astype(np.uint32).view(np.float32)


def mxfp4(b):
    return KVALUES_MXFP4[_nibbles(b["qs"])].astype(F32) * e8m0_half(b["e"])[:, None]


def ue4m3_half(x: np.ndarray) -> np.ndarray:
    """ggml_ue4m3_to_fp32: an unsigned e4m3 (bias 7; bit 7 ignored; 0 and 0x7F read as 0), times
    0.5 (KVALUES_MXFP4 are doubled). Exact in float32."""
    x = np.asarray(x).astype(np.int32)
    exp, man = (x >> 3) & 0xF, x & 0x7
    normal = np.ldexp(F32(1.0) + man.astype(F32) / F32(8.0), exp - 7).astype(F32)
    sub = np.ldexp(man.astype(F32), -9).astype(F32)
    raw = np.where(exp == 0, sub, normal).astype(F32)
    return np.where((x == 0) | (x == 0x7F), F32(0.0), raw * F32(0.5)).astype(F32)


def nvfp4(b):
    """64 weights as 4 sub-blocks of 16, each its own ue4m3 scale and 16-weight nibble order."""
    qs = b["qs"].reshape(-1, 4, 8)  # [N, sub, 8]
    v = KVALUES_MXFP4[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)].astype(F32)  # [N, sub, 16]
    return (v * ue4m3_half(b["d"])[..., None]).reshape(-1, 64)


# ---------------------------------------------------------------- K-quants (256 weights)


def q2_k(b):
    """Weight 128h + 32j + l: bits 2j of qs[32h + l]; scale byte 8h + 2j + l // 16 (low nibble
    scale, high nibble min)."""
    q = (b["qs"].reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [N, h, j, l]
    sc = b["scales"].reshape(-1, 2, 4, 2).repeat(16, axis=-1)  # [N, h, j, l]
    d, dmin = _f32(b["d"])[:, None, None, None], _f32(b["dmin"])[:, None, None, None]
    dl, ml = d * (sc & 0xF).astype(F32), dmin * (sc >> 4).astype(F32)
    return (dl * q.astype(F32) - ml).reshape(-1, 256)


def q3_k_scales(raw: np.ndarray) -> np.ndarray:
    """Q3_K's 16 6-bit scales from its 12 bytes: scale k's low 4 bits are nibble k // 8 of byte
    k % 8, its high 2 bits are bits 2 * (k // 4) of byte 8 + k % 4. [N, 12] -> [N, 16] int32"""
    k = np.arange(16)
    raw = raw.astype(np.int32)
    low = (raw[:, k % 8] >> (4 * (k // 8))) & 0xF
    high = (raw[:, 8 + k % 4] >> (2 * (k // 4))) & 3
    return low | (high << 4)


def q3_k(b):
    """Weight 128h + 32j + l: bits 2j of qs[32h + l], minus 4 unless bit 4h + j of hmask[l] is
    set; scale 8h + 2j + l // 16, less 32."""
    j = np.arange(4, dtype=np.uint8)
    q = (b["qs"].reshape(-1, 2, 1, 32) >> (2 * j)[:, None]) & 3  # [N, h, j, l]
    hbit = _bits(b["hmask"], 8).reshape(-1, 32, 2, 4).transpose(0, 2, 3, 1)  # [N, l, h, j] -> [N, h, j, l]
    q = q.astype(np.int32) - np.where(hbit != 0, 0, 4)
    sc = (q3_k_scales(b["scales"]) - 32).reshape(-1, 2, 4, 2).repeat(16, axis=-1)
    dl = _f32(b["d"])[:, None, None, None] * sc.astype(F32)
    return (dl * q.astype(F32)).reshape(-1, 256)


def k4_scales_mins(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for all 8 sub-blocks of a Q4_K / Q5_K block: 6-bit scales and mins
    from 12 bytes. [N, 12] -> ([N, 8], [N, 8]) int32"""
    q = raw.astype(np.int32)
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
    return sc, mn


def _k4(b, q: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: value = d * sc * q - dmin * m per 32-weight sub-block. q [N, 8, 32]"""
    sc, mn = k4_scales_mins(b["scales"])
    d1 = _f32(b["d"])[:, None] * sc.astype(F32)  # [N, 8]
    m1 = _f32(b["dmin"])[:, None] * mn.astype(F32)
    return (d1[..., None] * q.astype(F32) - m1[..., None]).reshape(-1, 256)


def _k4_nibbles(qs: np.ndarray) -> np.ndarray:
    """Sub-block 2i is the low nibbles of qs[32i : 32i + 32], sub-block 2i + 1 their high ones."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)


def q4_k(b):
    return _k4(b, _k4_nibbles(b["qs"]))


def q5_k(b):
    """Q4_K's layout plus a fifth bit: bit s of qh[l] for weight l of sub-block s."""
    high = _bits(b["qh"], 8).transpose(0, 2, 1)  # [N, l, s] -> [N, s, l]
    return _k4(b, _k4_nibbles(b["qs"]).astype(np.int32) + 16 * high.astype(np.int32))


def q6_k(b):
    """Weight 128h + 32k + l: nibble k // 2 of ql[64h + 32(k % 2) + l], bits 2k of qh[32h + l]
    as bits 4-5, less 32; scale 8h + 2k + l // 16 (int8)."""
    ql = b["ql"].reshape(-1, 2, 2, 32)  # [N, h, k % 2, l]
    low = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)  # [N, h, k, l]
    qh = b["qh"].reshape(-1, 2, 1, 32)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    q = (low.astype(np.int32) | (high.astype(np.int32) << 4)) - 32
    sc = b["scales"].reshape(-1, 2, 4, 2).repeat(16, axis=-1)  # [N, h, k, l]
    return ((_f32(b["d"])[:, None, None, None] * sc.astype(F32)) * q.astype(F32)).reshape(-1, 256)


# ---------------------------------------------------------------- ternary


def tq1_0(b):
    """Base-3 digits: byte x holds five, digit n = (uint8(x * 3**n) * 3) >> 8; value (digit - 1) * d.
    Weights 0..159 from qs[0:32] (160n' ordering: digit n of byte m is weight 32n + m), 160..239
    from qs[32:48] (160 + 16n + m), 240..255 from qh (240 + 4n + m, four digits each)."""
    def digits(x: np.ndarray, n: int) -> np.ndarray:  # [N, bytes] -> [N, n, bytes]
        q = (x[:, None, :].astype(np.uint16) * TQ_POW3[:n, None]).astype(np.uint8)  # the uint8 product wraps
        return ((q.astype(np.uint16) * 3) >> 8).astype(np.int32)

    parts = [digits(b["qs"][:, :32], 5), digits(b["qs"][:, 32:], 5), digits(b["qh"], 4)]
    t = np.concatenate([p.reshape(p.shape[0], -1) for p in parts], axis=1)
    return (t - 1).astype(F32) * _d(b)


def tq2_0(b):
    """2-bit codes: weight 128i + 32l + m is bits 2l of qs[32i + m]; value (q - 1) * d."""
    q = (b["qs"].reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    return (q.astype(np.int32) - 1).astype(F32).reshape(-1, 256) * _d(b)


# ---------------------------------------------------------------- IQ types (256 weights)


def _signs(s: np.ndarray) -> np.ndarray:
    """A sign byte per 8 weights -> +-1.0 per weight (bit j set: weight j negative). [...] -> [..., 8]"""
    return np.where(_bits(s, 8) != 0, F32(-1.0), F32(1.0))


def _iq_product(db: np.ndarray, values: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """db * grid value * sign, in C's order. db [N, g, 1], values/signs [N, g, w]"""
    return (db * values.astype(F32)) * signs


def iq2_xxs(b):
    """Per 32 weights, two u32: the first's 4 bytes index iq2xxs_grid (8 weights each), the
    second has 4 x 7 sign bits (-> ksigns) and a 4-bit scale in its top bits;
    db = d * (0.5 + s) * 0.25."""
    w = b["qs"].reshape(-1, 8, 4)  # [N, ib, u16]
    aux0 = w[..., 0].astype(np.uint32) | (w[..., 1].astype(np.uint32) << 16)
    aux1 = w[..., 2].astype(np.uint32) | (w[..., 3].astype(np.uint32) << 16)
    idx = (aux0[..., None] >> (8 * np.arange(4, dtype=np.uint32))) & 0xFF  # [N, ib, l]
    sidx = (aux1[..., None] >> (7 * np.arange(4, dtype=np.uint32))) & 127
    db = (_f32(b["d"])[:, None] * (F32(0.5) + (aux1 >> 28).astype(F32))) * F32(0.25)  # [N, ib]
    vals = gb.grid("iq2xxs")[idx]  # [N, ib, l, 8]
    return _iq_product(db[..., None, None], vals, _signs(KSIGNS_IQ2XS[sidx])).reshape(-1, 256)


def _iq2_db(b) -> np.ndarray:
    """IQ2_XS / IQ2_S: two 4-bit scales per 32 weights (low nibble: weights 0-15, high: 16-31);
    db = d * (0.5 + s) * 0.25. [N, ib, l] for the 4 groups of 8."""
    sc = b["scales"].reshape(-1, 8, 1)
    s = np.concatenate([sc & 0xF, sc & 0xF, sc >> 4, sc >> 4], axis=-1)  # [N, ib, l]
    return (_f32(b["d"])[:, None, None] * (F32(0.5) + s.astype(F32))) * F32(0.25)


def iq2_xs(b):
    """Per 8 weights a u16: bits 0-8 index iq2xs_grid, bits 9-15 the signs (-> ksigns)."""
    q = b["qs"].reshape(-1, 8, 4)
    vals = gb.grid("iq2xs")[q & 511]
    return _iq_product(_iq2_db(b)[..., None], vals, _signs(KSIGNS_IQ2XS[q >> 9])).reshape(-1, 256)


def iq2_s(b):
    """Per 8 weights a 10-bit grid index (qs byte, 2 more bits from qh) and a whole sign byte."""
    lo = b["qs"][:, :32].reshape(-1, 8, 4).astype(np.int32)
    signs = b["qs"][:, 32:].reshape(-1, 8, 4)
    qh = b["qh"].astype(np.int32)[..., None]  # [N, ib, 1]
    idx = lo | ((qh << (8 - 2 * np.arange(4))) & 0x300)
    vals = gb.grid("iq2s")[idx]
    return _iq_product(_iq2_db(b)[..., None], vals, _signs(signs)).reshape(-1, 256)


def iq3_xxs(b):
    """qs[0:64]: one iq3xxs_grid index per 4 weights; qs[64:96]: per 32 weights a u32 with 4 x 7
    sign bits (-> ksigns, 8 weights each) and a 4-bit scale on top; db = d * (0.5 + s) * 0.5."""
    idx = b["qs"][:, :64].reshape(-1, 8, 4, 2)  # [N, ib, l, half]
    aux = b["qs"][:, 64:].copy().view("<u4").reshape(-1, 8)  # [N, ib]
    sidx = (aux[..., None] >> (7 * np.arange(4, dtype=np.uint32))) & 127
    db = (_f32(b["d"])[:, None] * (F32(0.5) + (aux >> 28).astype(F32))) * F32(0.5)
    vals = gb.grid("iq3xxs")[idx].reshape(-1, 8, 4, 8)  # [N, ib, l, 8]
    return _iq_product(db[..., None, None], vals, _signs(KSIGNS_IQ2XS[sidx])).reshape(-1, 256)


def iq3_s(b):
    """Per 32 weights (sub-block s): 8 grid indices (qs byte, bit 8 from qh[s]), 4 sign bytes,
    and a 4-bit scale (nibble s % 2 of scales[s // 2]); db = d * (1 + 2 * scale)."""
    lo = b["qs"].reshape(-1, 8, 8).astype(np.int32)  # [N, s, i]
    qh = _bits(b["qh"], 8).astype(np.int32)  # [N, s, bit]: index i's 9th bit is bit i of qh[s]
    vals = gb.grid("iq3s")[lo | (qh << 8)].reshape(-1, 8, 4, 8)  # [N, s, l, 8]
    sc = b["scales"].reshape(-1, 4, 1)
    nib = np.concatenate([sc & 0xF, sc >> 4], axis=-1).reshape(-1, 8).astype(np.int32)  # [N, s]
    db = _f32(b["d"])[:, None] * (1 + 2 * nib).astype(F32)
    signs = _signs(b["signs"].reshape(-1, 8, 4))
    return _iq_product(db[..., None, None], vals, signs).reshape(-1, 256)


def _iq1(dl: np.ndarray, idx: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """value = dl * (grid value + delta) per 8 weights. dl, delta [N, ib, l]; idx [N, ib, l]"""
    vals = gb.grid("iq1s")[idx].astype(F32)  # [N, ib, l, 8]
    return (dl[..., None] * (vals + delta[..., None])).reshape(-1, 256)


def iq1_s(b):
    """Per 32 weights a u16 qh: bits 3l..3l+2 are the high bits of group l's 11-bit grid index,
    bits 12-14 a scale (dl = d * (2s + 1)), bit 15 the sign of delta (+-0.125)."""
    qh = b["qh"].astype(np.int32)  # [N, ib]
    lo = b["qs"].reshape(-1, 8, 4).astype(np.int32)
    idx = lo | (((qh[..., None] >> (3 * np.arange(4))) & 7) << 8)
    dl = _f32(b["d"])[:, None] * (2 * ((qh >> 12) & 7) + 1).astype(F32)
    delta = np.where(qh & 0x8000, -IQ1_DELTA, IQ1_DELTA).astype(F32)
    return _iq1(np.repeat(dl[..., None], 4, -1), idx, np.repeat(delta[..., None], 4, -1))


def iq1_m_scale(scales: np.ndarray) -> np.ndarray:
    """IQ1_M's float16 block scale: the top nibble of each of its 4 u16 scale words. [N, 8] -> [N]"""
    sc = scales.copy().view("<u2").astype(np.uint16)  # [N, 4]
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    return bits.astype(np.uint16).view(np.float16).astype(F32)


def iq1_m(b):
    """Per 32 weights: two 3-bit scales (bits 6(ib%2) and +3 of u16 scales[ib // 2]; groups 0-1
    and 2-3), 4 grid indices with 3 high bits each from qh nibbles, whose bit 3 is delta's sign."""
    sc = b["scales"].copy().view("<u2").astype(np.int32)  # [N, 4]
    ib = np.arange(8)
    word = sc[:, ib // 2]  # [N, ib]
    s1 = (word >> (6 * (ib % 2))) & 7
    s2 = (word >> (6 * (ib % 2) + 3)) & 7
    d = iq1_m_scale(b["scales"])[:, None]
    dl1, dl2 = d * (2 * s1 + 1).astype(F32), d * (2 * s2 + 1).astype(F32)
    dl = np.stack([dl1, dl1, dl2, dl2], axis=-1)  # [N, ib, l]
    qh = b["qh"].reshape(-1, 8, 2).astype(np.int32)
    nib = np.stack([qh[..., 0] & 0xF, qh[..., 0] >> 4, qh[..., 1] & 0xF, qh[..., 1] >> 4], axis=-1)  # [N, ib, l]
    idx = b["qs"].reshape(-1, 8, 4).astype(np.int32) | ((nib & 7) << 8)
    delta = np.where(nib & 8, -IQ1_DELTA, IQ1_DELTA).astype(F32)
    return _iq1(dl, idx, delta)


def iq4_xs(b):
    """Per 32 weights a 6-bit scale (low 4 bits: nibble ib % 2 of scales_l[ib // 2], high 2:
    bits 2ib of scales_h), dl = d * (scale - 32); weights as IQ4_NL's 16 bytes."""
    ib = np.arange(8)
    low = (b["scales_l"][:, ib // 2].astype(np.int32) >> (4 * (ib % 2))) & 0xF
    high = (b["scales_h"].astype(np.int32)[:, None] >> (2 * ib)) & 3
    dl = _f32(b["d"])[:, None] * ((low | (high << 4)) - 32).astype(F32)  # [N, ib]
    v = KVALUES_IQ4NL[_nibbles(b["qs"].reshape(-1, 8, 16))].astype(F32)  # [N, ib, 32]
    return (dl[..., None] * v).reshape(-1, 256)


# ggml type name -> its dequantizer over block records
DEQUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q8_0": q8_0, "Q2_K": q2_k, "Q3_K": q3_k,
    "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k, "IQ2_XXS": iq2_xxs, "IQ2_XS": iq2_xs, "IQ2_S": iq2_s,
    "IQ3_XXS": iq3_xxs, "IQ3_S": iq3_s, "IQ1_S": iq1_s, "IQ1_M": iq1_m, "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs,
    "TQ1_0": tq1_0, "TQ2_0": tq2_0, "MXFP4": mxfp4, "NVFP4": nvfp4,
}
assert DEQUANTIZERS.keys() == gb.BLOCK_DTYPES.keys()


def dequantize_blocks(name: str, raw: np.ndarray, n_cols: int) -> np.ndarray:
    """Rows of ggml blocks -> float32 weights, as ggml's dequantize_row_<name>.

    Shapes:
        raw: uint8 [R, n_cols / block * block_bytes] (or any shape holding those bytes) -> [R, n_cols]
    """
    block, _ = gb.BLOCK_DTYPES[name]
    if n_cols % block:
        raise ValueError(f"{name} rows must be a multiple of {block} weights, got {n_cols}")
    blocks = gb.view_blocks(name, raw)
    return np.ascontiguousarray(DEQUANTIZERS[name](blocks), np.float32).reshape(-1, n_cols)


def bf16(raw: np.ndarray) -> np.ndarray:
    """Raw bfloat16 bytes -> float32 (the bits << 16, exact). [..., 2n] uint8 -> [..., n]"""
    u = np.ascontiguousarray(raw, np.uint8).view("<u2")
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


def dequantize_rows(qtype: int, raw: np.ndarray, n_cols: int) -> np.ndarray:
    """Rows of any type a GGUF tensor holds (the floats too) -> float32, as ggml widens them: F32
    as stored, F16 and BF16 exactly, the block types by `dequantize_blocks`. qtype: ggml's type id.

    Shapes:
        raw: uint8 [R, row bytes] (or any shape holding those bytes) -> [R, n_cols]
    """
    qtype = QuantType(qtype)
    raw = np.ascontiguousarray(raw, np.uint8)
    if qtype is QuantType.F32:
        return raw.view("<f4").reshape(-1, n_cols).astype(np.float32)
    if qtype is QuantType.F16:
        return raw.view("<f2").astype(np.float32).reshape(-1, n_cols)
    if qtype is QuantType.BF16:
        return bf16(raw).reshape(-1, n_cols)
    return dequantize_blocks(ggml_block_name(qtype), raw, n_cols)
