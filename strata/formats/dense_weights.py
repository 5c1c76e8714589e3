"""Dense weights kept in memory as the model file stores them, widened to float32 per use.

The loader used to widen every dense tensor to float32 at load, so a model whose dense part is
22 MB as Q8_0 held 88.5 MB (4 bytes per weight whatever the file held). Now a tensor stored as
F16, BF16 or Q8_0 stays in those bytes (`StoredTensor`) and `DenseWeights[name]` widens it when
a matmul asks: the values are exactly what widening at load gave (gguf's own formulas below), so
every float32 computation downstream is bit-identical to before. F32 tensors (routers, norms,
biases, rows that are not whole Q8_0 blocks) are plain float32 arrays, returned as they are.

    F16   float16 [shape]                        2 bytes per weight
    BF16  uint16 [shape] (the bfloat16 bits)     2 bytes per weight
    Q8_0  int8 codes [R, C], float16 d [R, C/32] 34 bytes per 32 weights (value = d * code)
    Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS, MXFP4, Q5_1 (llama.cpp's block types a CPU
          matmul computes on their stored bytes: docs/cpu.md)
          uint8 [R, C / block * block bytes]: the rows of whole ggml blocks, scales inside;
          widened with the `gguf` package's dequantizer, the values loading gave before

R is the product of the leading dims, C the last (the row length a block runs along).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterator, Mapping, MutableMapping

import numpy as np

from strata.formats import ggml_blocks
from strata.formats.quant_types import QuantType, ggml_block_name, layout, row_bytes

__all__ = ["StoredType", "StoredTensor", "DenseWeights", "as_dense_weights", "stored_bytes", "non_finite_blocks"]

Q8 = layout(QuantType.Q8_0)


class StoredType(enum.Enum):
    """The dense types kept in memory as stored (ggml's type ids): the ones a matmul widens
    cheaply per use, and llama.cpp's block types the CPU's compiled kernels compute on their
    stored bytes (a GGUF's Q6_K head and attention: 0.82 bytes a weight held, not float32's 4).
    Their own enum, not QuantType: which types memory keeps is this module's choice, not the
    file format's (a file may hold any QuantType; the rest are widened at load)."""

    F16 = 1
    BF16 = 30
    Q8_0 = 8
    Q5_1 = 7
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    IQ4_XS = 23
    MXFP4 = 39  # ggml's (QuantType.GGML_MXFP4)

    @property
    def whole_blocks(self) -> bool:
        """Held as rows of whole ggml blocks (scales inside), not as codes and a scales plane."""
        return self not in (StoredType.F16, StoredType.BF16, StoredType.Q8_0)

    @property
    def quant_type(self) -> QuantType:
        return QuantType(self.value)

    @classmethod
    def of(cls, ggml_type: int) -> "StoredType | None":
        """The stored type of a ggml type id; None: widened to float32 at load (F32 itself, or a
        type this module does not keep)."""
        try:
            return cls(int(ggml_type))
        except ValueError:
            return None


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """One dense tensor in its stored type.

    Shapes:
        codes: F16 float16 [shape]; BF16 uint16 [shape]; Q8_0 int8 [R, C]
        (llama.cpp's block types: uint8 [R, row bytes], whole blocks)
        scales: Q8_0 float16 [R, C/32]; else None
        widen() -> float32 [shape]
    """

    qtype: StoredType
    shape: tuple[int, ...]
    codes: np.ndarray
    scales: np.ndarray | None = None

    def __post_init__(self) -> None:
        want = {StoredType.F16: np.float16, StoredType.BF16: np.uint16, StoredType.Q8_0: np.int8}.get(self.qtype,
                                                                                                    np.uint8)
        if self.codes.dtype != want:
            raise ValueError(f"StoredTensor {self.qtype.name}: codes must be {np.dtype(want)}, got {self.codes.dtype}")
        if self.qtype is StoredType.Q8_0:
            rows, cols = self.rows_cols
            blocks = (rows, cols // Q8.block_size)
            if cols % Q8.block_size or self.codes.shape != (rows, cols):
                raise ValueError(f"StoredTensor Q8_0 {self.shape}: codes {self.codes.shape}, rows must be whole blocks")
            if self.scales is None or self.scales.dtype != np.float16 or self.scales.shape != blocks:
                raise ValueError(f"StoredTensor Q8_0 {self.shape}: scales must be float16 {blocks}")
        elif self.qtype.whole_blocks:
            rows, cols = self.rows_cols
            want_shape = (rows, row_bytes(self.qtype.quant_type, cols))  # validates whole blocks
            if self.codes.shape != want_shape or self.scales is not None:
                raise ValueError(f"StoredTensor {self.qtype.name} {self.shape}: codes {self.codes.shape}, "
                                 f"want uint8 {want_shape} and no scales")
        elif self.codes.shape != self.shape:
            raise ValueError(f"StoredTensor {self.qtype.name}: codes shape {self.codes.shape}, want {self.shape}")

    @property
    def rows_cols(self) -> tuple[int, int]:
        cols = self.shape[-1]
        return int(np.prod(self.shape[:-1], dtype=np.int64)), cols

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """The bytes it keeps in memory: the stored bytes."""
        return self.codes.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The buffers that hold it (to wire them)."""
        return (self.codes,) if self.scales is None else (self.codes, self.scales)

    def widen(self) -> np.ndarray:
        """float32 [shape]: gguf.quants.dequantize's values (F16: astype; BF16: the bits << 16;
        Q8_0: float32(code) * float32(d) per block)."""
        return self._widen(self.codes, self.scales).reshape(self.shape)

    def widen_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a 2-D tensor, widened (an embedding lookup widens only the rows it
        reads). ids int [T] -> float32 [T, C]"""
        if self.ndim != 2:
            raise ValueError(f"widen_rows: a 2-D tensor wanted, this one is {self.shape}")
        return self._widen(self.codes[ids], None if self.scales is None else self.scales[ids])

    def _widen(self, codes: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
        if self.qtype.whole_blocks:  # gguf's dequantizer: what loading widened these to before
            import gguf

            cols = self.shape[-1]
            out = gguf.quants.dequantize(codes, gguf.GGMLQuantizationType(self.qtype.value))
            return np.asarray(out, np.float32).reshape(codes.shape[0], cols)
        if self.qtype is StoredType.F16:
            return codes.astype(np.float32)
        if self.qtype is StoredType.BF16:
            return (codes.astype(np.uint32) << 16).view(np.float32)
        n = codes.shape[0]
        out = codes.astype(np.float32)  # [R, C]; scaled in place: one float32 copy alive, not two
        out.reshape(n, -1, Q8.block_size)[...] *= scales.astype(np.float32)[:, :, None]  # [R, C/32, 32]
        return out

    @classmethod
    def from_gguf(cls, qtype: StoredType, raw: np.ndarray, shape: tuple[int, ...]) -> "StoredTensor":
        """From the bytes `GGUFFile.raw` gives (copied: the result owns its memory, no view into
        the file's map). F16: float16 [shape]; BF16, Q8_0 and the block types: uint8 rows of blocks."""
        raw = np.ascontiguousarray(raw)
        if qtype.whole_blocks:
            rows = int(np.prod(shape[:-1], dtype=np.int64))
            return cls(qtype, shape, raw.view(np.uint8).reshape(rows, -1).copy())
        if qtype is StoredType.F16:
            return cls(qtype, shape, raw.view(np.float16).reshape(shape).copy())
        if qtype is StoredType.BF16:
            return cls(qtype, shape, raw.view(np.uint16).reshape(shape).copy())
        cols = shape[-1]
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        blocks = raw.reshape(-1, 2 + Q8.block_size)  # ggml's block_q8_0: float16 d, then 32 int8 codes
        scales = blocks[:, :2].copy().view(np.float16).reshape(rows, cols // Q8.block_size)
        codes = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
        return cls(qtype, shape, codes, scales)


def non_finite_blocks(t: StoredTensor) -> int:
    """How many of a block type's blocks widen to a NaN or an infinity, read from their scale
    fields (strata.formats.ggml_blocks.non_finite_blocks), never by widening."""
    return int(np.count_nonzero(ggml_blocks.non_finite_blocks(ggml_block_name(t.qtype.quant_type), t.codes)))


Dense = np.ndarray | StoredTensor


class DenseWeights(MutableMapping):
    """name -> float32 array, widened on access from what is held (`stored(name)`): a plain
    float32 array or a StoredTensor. Holding a mapping keeps it (no copy); assigning a name
    holds the value given (a test's patched weight)."""

    def __init__(self, held: MutableMapping[str, Dense]) -> None:
        self._held = held

    def __setitem__(self, name: str, value: Dense) -> None:
        self._held[name] = value

    def __delitem__(self, name: str) -> None:
        del self._held[name]

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._held[name]
        return t.widen() if isinstance(t, StoredTensor) else t

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, name: object) -> bool:
        return name in self._held

    def stored(self, name: str) -> Dense:
        """What is held for `name`: a float32 array (F32 tensors) or a StoredTensor."""
        return self._held[name]

    @property
    def held(self) -> MutableMapping[str, Dense]:
        """The mapping held (not a copy): another view of the same weights shares it."""
        return self._held

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        """x W^T for the 2-D matrix `name`, widened to float32: the product every dense matrix is
        used in (a subclass may compute it on the stored bytes: strata.numpy_backend.quant_kernels).
        x [T, C] -> [T, R]"""
        return x @ self[name].T

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a 2-D tensor in float32, widening only those. ids int [T] -> [T, C]"""
        t = self._held[name]
        return t.widen_rows(ids) if isinstance(t, StoredTensor) else np.asarray(t, np.float32)[ids]

    def stored_type(self, name: str) -> StoredType | None:
        """The tensor's stored type; None: held as float32."""
        t = self._held[name]
        return t.qtype if isinstance(t, StoredTensor) else None

    def arrays(self) -> Iterator[np.ndarray]:
        """Every buffer held (to wire them), without widening anything."""
        for t in self._held.values():
            yield from (t.arrays() if isinstance(t, StoredTensor) else (t,))

    @property
    def nbytes(self) -> int:
        """The bytes held in memory: the stored bytes, not float32's."""
        return sum(int(a.nbytes) for a in self.arrays())


def as_dense_weights(dense: Mapping[str, Dense]) -> DenseWeights:
    """`dense` itself when it is a DenseWeights, else a DenseWeights holding it (a plain dict of
    float32 arrays, as tests and made models build them)."""
    return dense if isinstance(dense, DenseWeights) else DenseWeights(dense)


def stored_bytes(dense: Mapping[str, Dense]) -> int:
    """The bytes a dense mapping really holds (its stored bytes)."""
    return as_dense_weights(dense).nbytes
