"""One routed expert as one on-disk record: the byte layout of a record of an `.experts` file.

A record holds the three projections of one (layer, expert), each as two planes (all codes,
then all block scales: float16, or MLX's scales and biases / e8m0 bytes for MLX's types), in the order gate codes, gate scales, up codes, up scales,
down codes, down scales. Every plane starts on a PLANE_ALIGN boundary so a GPU kernel can read
codes as aligned uint32 / uint4 words straight out of an arena slot; the record is zero-padded
to RECORD_ALIGN so one pread (O_DIRECT where available) of `padded_bytes` fills one slot.
A record of experts with biases (gpt-oss) appends three float32 planes after those six: gate
bias [F], up bias [F], down bias [D]; the six planes before them sit where they always do.
The three projections may each have their own type (a llama.cpp GGUF's Q4_K gate/up with a Q5_1
down): the planes are laid out the same way, each sized by its projection's type.
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
BIAS_PLANE_NAMES = ("gate.bias", "up.bias", "down.bias")  # float32, only in records with biases
BIAS_DTYPE = np.dtype("<f4")


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True, eq=False)
class ExpertBiases:
    """The biases of one expert's projections (gpt-oss). Shapes: gate [F], up [F], down [D] float32"""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray

    def projection(self, name: str) -> np.ndarray:
        return getattr(self, name)


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """The three projections of one routed expert (each its own QuantType: a GGUF's mixes them),
    and their biases if the model's experts have them.

    Shapes:
        gate: [F, D]   up: [F, D]   down: [D, F]     (D = hidden, F = expert_ffn)
    """

    gate: QuantMatrix
    up: QuantMatrix
    down: QuantMatrix
    biases: ExpertBiases | None = None

    def __post_init__(self) -> None:
        f, d = self.gate.shape
        if self.up.shape != (f, d) or self.down.shape != (d, f):
            raise ValueError(
                f"expert weights: gate {self.gate.shape}, up {self.up.shape}, down {self.down.shape}; "
                f"want gate/up [F, D] and down [D, F]"
            )
        b = self.biases
        if b is not None and any(np.asarray(v).dtype != BIAS_DTYPE or np.shape(v) != (n,)
                                 for v, n in ((b.gate, f), (b.up, f), (b.down, d))):
            raise ValueError(f"expert biases: want float32 gate [{f}], up [{f}], down [{d}], got "
                             f"{[(np.asarray(v).dtype.name, np.shape(v)) for v in (b.gate, b.up, b.down)]}")

    @property
    def qtypes(self) -> tuple[QuantType, QuantType, QuantType]:
        """(gate, up, down) types."""
        return (self.gate.qtype, self.up.qtype, self.down.qtype)

    @property
    def qtype(self) -> QuantType:
        """The one type of all three projections; ValueError where they mix (read `qtypes`)."""
        return _one_type(self.qtypes)

    @property
    def hidden(self) -> int:
        return self.gate.n_cols

    @property
    def expert_ffn(self) -> int:
        return self.gate.n_rows

    def projection(self, name: str) -> QuantMatrix:
        return getattr(self, name)


def _one_type(qtypes: tuple[QuantType, ...]) -> QuantType:
    if len(set(qtypes)) != 1:
        raise ValueError(f"the projections mix quant types {'/'.join(q.name for q in qtypes)} (gate/up/down); "
                         "this path computes one type per expert")
    return qtypes[0]


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

    `planes` follows PLANE_NAMES, then BIAS_PLANE_NAMES when `biases`. `record_bytes` is the end
    of the last plane (what the checksum covers); `padded_bytes` rounds it up to RECORD_ALIGN
    (the record stride in the file and the size of one arena slot). `up_qtype` / `down_qtype`
    give those projections their own types (None: `qtype`, the gate's, as every single-type record).
    """

    qtype: QuantType
    hidden: int
    expert_ffn: int
    biases: bool = False
    up_qtype: QuantType | None = None
    down_qtype: QuantType | None = None
    planes: tuple[PlaneSpan, ...] = field(init=False)
    record_bytes: int = field(init=False)
    padded_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        qtype = QuantType(self.qtype)
        object.__setattr__(self, "qtype", qtype)
        for name in ("up_qtype", "down_qtype"):  # the same type as the gate's is written as None
            q = getattr(self, name)
            object.__setattr__(self, name, None if q is None or QuantType(q) is qtype else QuantType(q))
        if self.hidden <= 0 or self.expert_ffn <= 0:
            raise ValueError(f"record layout: hidden={self.hidden} and expert_ffn={self.expert_ffn} must be positive")
        # blocks run along rows: gate/up rows are `hidden` long, down rows `expert_ffn` (llama.cpp's
        # UD files pair K-quant gate/up with 32-block downs where expert_ffn is no multiple of 256)
        for proj, q in zip(PROJECTIONS, self.qtypes):
            block = layout(q).block_size
            name, n = ("expert_ffn", self.expert_ffn) if proj == "down" else ("hidden", self.hidden)
            if n % block:
                raise ValueError(f"record layout: {q.name} {proj} needs {name} a multiple of {block}, got {n}")
        planes: list[PlaneSpan] = []
        end = 0
        for proj in PROJECTIONS:
            rows, cols = self.shape(proj)
            lay = layout(self.qtype_of(proj))
            n_blocks = rows * (cols // lay.block_size)
            for nbytes in (n_blocks * lay.code_bytes, n_blocks * lay.scale_bytes):
                start = align_up(end, PLANE_ALIGN)
                planes.append(PlaneSpan(start, nbytes))
                end = start + nbytes
        for proj in PROJECTIONS if self.biases else ():
            start = align_up(end, PLANE_ALIGN)
            planes.append(PlaneSpan(start, self.shape(proj)[0] * BIAS_DTYPE.itemsize))
            end = planes[-1].end
        object.__setattr__(self, "planes", tuple(planes))
        object.__setattr__(self, "record_bytes", end)
        object.__setattr__(self, "padded_bytes", align_up(end, RECORD_ALIGN))

    @property
    def qtypes(self) -> tuple[QuantType, QuantType, QuantType]:
        """(gate, up, down) types."""
        return (self.qtype, self.up_qtype or self.qtype, self.down_qtype or self.qtype)

    @property
    def mixed(self) -> bool:
        """The projections do not all have one type."""
        return len(set(self.qtypes)) > 1

    def qtype_of(self, proj: str) -> QuantType:
        return self.qtypes[PROJECTIONS.index(proj)]

    @property
    def type_names(self) -> str:
        """'Q4_K' or 'Q4_K/Q4_K/Q5_1' (gate/up/down), for messages."""
        return "/".join(q.name for q in self.qtypes) if self.mixed else self.qtype.name

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

    def bias(self, proj: str) -> PlaneSpan:
        """A projection's bias plane (records with biases only)."""
        if not self.biases:
            raise ValueError(f"record layout of {self.type_names} D={self.hidden} F={self.expert_ffn} has no biases")
        return self.planes[len(PLANE_NAMES) + PROJECTIONS.index(proj)]

    @property
    def plane_names(self) -> tuple[str, ...]:
        return PLANE_NAMES + (BIAS_PLANE_NAMES if self.biases else ())


def pack_record(w: ExpertWeights, rec: RecordLayout) -> bytes:
    """The `padded_bytes` bytes of one record (planes at their offsets, zeros elsewhere)."""
    if (w.qtypes != rec.qtypes or (w.expert_ffn, w.hidden) != (rec.expert_ffn, rec.hidden)
            or (w.biases is not None) != rec.biases):
        with_b = lambda b: " with biases" if b else ""  # noqa: E731
        names = "/".join(q.name for q in w.qtypes) if len(set(w.qtypes)) > 1 else w.gate.qtype.name
        raise ValueError(
            f"expert is {names} F={w.expert_ffn} D={w.hidden}{with_b(w.biases is not None)}, the record "
            f"layout wants {rec.type_names} F={rec.expert_ffn} D={rec.hidden}{with_b(rec.biases)}"
        )
    buf = np.zeros(rec.padded_bytes, np.uint8)
    for proj in PROJECTIONS:
        m = w.projection(proj)
        for span, plane in ((rec.codes(proj), m.codes), (rec.scales(proj), m.scale_plane())):
            buf[span.offset : span.end] = np.ascontiguousarray(plane).view(np.uint8).reshape(-1)
        if rec.biases:
            span = rec.bias(proj)
            buf[span.offset : span.end] = np.ascontiguousarray(w.biases.projection(proj), BIAS_DTYPE).view(np.uint8)
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
        mats.append(QuantMatrix.from_planes(rec.qtype_of(proj), rows, cols, data[c.offset : c.end],
                                            data[s.offset : s.end]))
    biases = None
    if rec.biases:
        biases = ExpertBiases(*(data[rec.bias(p).offset : rec.bias(p).end].view(BIAS_DTYPE) for p in PROJECTIONS))
    return ExpertWeights(*mats, biases=biases)
