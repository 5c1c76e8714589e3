"""One routed expert as one on-disk record: the byte layout of a record of an `.experts` file.

A record holds the three projections of one (layer, expert), each as two planes (all codes,
then all block scales: float16, or MLX's scales and biases / e8m0 bytes for MLX's types), in the order gate codes, gate scales, up codes, up scales,
down codes, down scales. Every plane starts on a PLANE_ALIGN boundary so a GPU kernel can read
codes as aligned uint32 / uint4 words straight out of an arena slot; the record is zero-padded
to RECORD_ALIGN so one pread (O_DIRECT where available) of `padded_bytes` fills one slot.
docs/formats.md is the normative description; this module is its one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.formats.quant_matrix import QuantMatrix
from strata.formats.quant_types import QuantType, layout

RECORD_ALIGN = 4096  # page size and O_DIRECT granularity: one record = whole pages
PLANE_ALIGN = 16  # widest aligned load the kernels use (uint4 / 128-bit)

PROJECTIONS = ("gate", "up", "down")
PLANE_NAMES = ("gate.codes", "gate.scales", "up.codes", "up.scales", "down.codes", "down.scales")


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """The three projections of one routed expert, all of one QuantType.

    Shapes:
        gate: [F, D]   up: [F, D]   down: [D, F]     (D = hidden, F = expert_ffn)
    """

    gate: QuantMatrix
    up: QuantMatrix
    down: QuantMatrix

    def __post_init__(self) -> None:
        qtypes = {self.gate.qtype, self.up.qtype, self.down.qtype}
        if len(qtypes) != 1:
            raise ValueError(f"expert weights mix quant types {sorted(q.name for q in qtypes)}")
        f, d = self.gate.shape
        if self.up.shape != (f, d) or self.down.shape != (d, f):
            raise ValueError(
                f"expert weights: gate {self.gate.shape}, up {self.up.shape}, down {self.down.shape}; "
                f"want gate/up [F, D] and down [D, F]"
            )

    @property
    def qtype(self) -> QuantType:
        return self.gate.qtype

    @property
    def hidden(self) -> int:
        return self.gate.n_cols

    @property
    def expert_ffn(self) -> int:
        return self.gate.n_rows

    def projection(self, name: str) -> QuantMatrix:
        return getattr(self, name)


@dataclass(frozen=True)
class PlaneSpan:
    """Where one plane sits inside a record: byte offset from the record start, and size."""

    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one record, computed from (qtype, hidden D, expert_ffn F).

    `planes` follows PLANE_NAMES. `record_bytes` is the end of the last plane (what the
    checksum covers); `padded_bytes` rounds it up to RECORD_ALIGN (the record stride in the file
    and the size of one arena slot).
    """

    qtype: QuantType
    hidden: int
    expert_ffn: int
    planes: tuple[PlaneSpan, ...] = field(init=False)
    record_bytes: int = field(init=False)
    padded_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        qtype = QuantType(self.qtype)
        object.__setattr__(self, "qtype", qtype)
        if self.hidden <= 0 or self.expert_ffn <= 0:
            raise ValueError(f"record layout: hidden={self.hidden} and expert_ffn={self.expert_ffn} must be positive")
        lay = layout(qtype)
        for name, n in (("hidden", self.hidden), ("expert_ffn", self.expert_ffn)):
            if n % lay.block_size:
                raise ValueError(f"record layout: {qtype.name} needs {name} a multiple of {lay.block_size}, got {n}")
        planes: list[PlaneSpan] = []
        end = 0
        for proj in PROJECTIONS:
            rows, cols = self.shape(proj)
            n_blocks = rows * (cols // lay.block_size)
            for nbytes in (n_blocks * lay.code_bytes, n_blocks * lay.scale_bytes):
                start = align_up(end, PLANE_ALIGN)
                planes.append(PlaneSpan(start, nbytes))
                end = start + nbytes
        object.__setattr__(self, "planes", tuple(planes))
        object.__setattr__(self, "record_bytes", end)
        object.__setattr__(self, "padded_bytes", align_up(end, RECORD_ALIGN))

    def shape(self, proj: str) -> tuple[int, int]:
        """[rows, cols] of a projection: gate/up [F, D], down [D, F]."""
        if proj == "down":
            return (self.hidden, self.expert_ffn)
        if proj in ("gate", "up"):
            return (self.expert_ffn, self.hidden)
        raise ValueError(f"unknown projection {proj!r}; expected one of {PROJECTIONS}")

    def codes(self, proj: str) -> PlaneSpan:
        return self.planes[2 * PROJECTIONS.index(proj)]

    def scales(self, proj: str) -> PlaneSpan:
        return self.planes[2 * PROJECTIONS.index(proj) + 1]


def pack_record(w: ExpertWeights, rec: RecordLayout) -> bytes:
    """The `padded_bytes` bytes of one record (planes at their offsets, zeros elsewhere)."""
    if w.qtype is not rec.qtype or (w.expert_ffn, w.hidden) != (rec.expert_ffn, rec.hidden):
        raise ValueError(
            f"expert is {w.qtype.name} F={w.expert_ffn} D={w.hidden}, the record layout wants "
            f"{rec.qtype.name} F={rec.expert_ffn} D={rec.hidden}"
        )
    buf = np.zeros(rec.padded_bytes, np.uint8)
    for proj in PROJECTIONS:
        m = w.projection(proj)
        for span, plane in ((rec.codes(proj), m.codes), (rec.scales(proj), m.scale_plane())):
            buf[span.offset : span.end] = np.ascontiguousarray(plane).view(np.uint8).reshape(-1)
    return buf.tobytes()


def unpack_record(buf: bytes | bytearray | memoryview | np.ndarray, rec: RecordLayout) -> ExpertWeights:
    """The ExpertWeights in a record buffer, as zero-copy views of `buf` (read-only if `buf` is).

    `buf` may be the unpadded record or longer (a padded record, an arena slot).
    """
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise ValueError(f"record buffer must be 1-D uint8, got {buf.dtype} {buf.shape}")
        data = buf
    else:
        data = np.frombuffer(buf, dtype=np.uint8)
    if data.size < rec.record_bytes:
        raise ValueError(f"record buffer has {data.size} bytes, the layout needs {rec.record_bytes}")
    mats = []
    for proj in PROJECTIONS:
        rows, cols = rec.shape(proj)
        c, s = rec.codes(proj), rec.scales(proj)
        mats.append(QuantMatrix.from_planes(rec.qtype, rows, cols, data[c.offset : c.end], data[s.offset : s.end]))
    return ExpertWeights(*mats)
