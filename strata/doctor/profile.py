"""A machine profile: what the probe (probe.py) measured of a machine, as the prediction reads it.

Apart from the probe so that the prediction (predict.py) and the engine fit (engine_fit.py) read a
profile without importing the code that measures one (which runs the fit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

import numpy as np

PROFILE_VERSION = 10  # 5: the widening tables (dense weights kept as stored); 6: steady rates, NNLS fit;
# 7: a base RSS per engine kind (base_rss_streaming); 8: the products the engine computes with
# (`products`: the compiled CPU kernels' tables, `kernel_gemv` and `expert_kernels`); 9: expert
# tables of llama.cpp's compiled block types (Q4_K ... Q5_1), a Q6_K dense kernel table; 10: the
# compiled kernels' thread count (`kernel_threads`), a profile per count
COMPILED, FLOAT32 = "compiled", "float32"  # a numpy profile's `products` (MLX: "")
QUICK_NOTE = "quick probe"  # how a quick probe's profile says so (its first note)


@dataclass(frozen=True)
class OpCost:
    """Seconds per call of one op as a function of the weight bytes it reads: measured points
    (bytes, seconds), interpolated in log-log; past the largest point, time grows with bytes
    at that point's rate; below the smallest, the smallest point's time (the call's own cost).
    A table rather than a line, because the rate depends on size: a numpy Q2_0 expert of
    1024 x 512 dequantizes into 2 MB temporaries and ran 3-4x slower per byte than one of
    256 x 128 here (docs/doctor.md)."""

    points: tuple[tuple[float, float], ...]

    def each(self, nbytes: float) -> float:
        xs = np.array([b for b, _ in self.points], float)
        ts = np.array([t for _, t in self.points], float)
        if nbytes >= xs[-1]:
            return float(ts[-1] * nbytes / xs[-1])
        if nbytes <= xs[0]:
            return float(ts[0])
        return float(np.exp(np.interp(np.log(nbytes), np.log(xs), np.log(ts))))

    def seconds(self, calls: float, nbytes: float) -> float:
        """`calls` calls reading `nbytes` in all (each call reads the mean)."""
        return calls * self.each(nbytes / calls) if calls else 0.0

    def to_dict(self) -> dict:
        return {"points": [list(p) for p in self.points]}

    @classmethod
    def from_dict(cls, d: dict) -> "OpCost":
        return cls(tuple((float(b), float(t)) for b, t in d["points"]))


@dataclass(frozen=True)
class MachineProfile:
    backend: str
    machine: str
    disk_latency_s: float
    disk_bytes_per_s: float
    disk_direct: bool
    mem_bytes_per_s: float
    gemv: OpCost
    expert: OpCost  # the expert op alone (microbenchmark), by record bytes
    expert_call_s: float  # the engine's cost per routed expert at `calibration_record_bytes` (measured in-engine)
    calibration_record_bytes: int
    layer_s: float
    turn_s: float
    turn_slot_s: float  # the turn's growth per arena slot (the cache's victim search passes pinned slots)
    read_s: float
    miss_s: float
    calibration_slot_bytes: int
    base_rss: int
    load_avg: float
    measured_at: float
    version: int = PROFILE_VERSION
    notes: tuple[str, ...] = field(default_factory=tuple)
    # stored dense type name -> seconds per call of widening it to float32, by stored bytes (the
    # numpy engines widen every dense matmul's weights; empty: no widening priced, MLX)
    widen: dict = field(default_factory=dict)
    # the engine runs the probe fitted (case -> seconds per call, counts, peak): kept to check a fit
    calibration: dict = field(default_factory=dict)
    gpu: bool = False  # the backend ran on a GPU when measured (MLX holds an F32 file's matrices as float16 there)
    sync_s: float = 0.0  # one host round trip, paid once per decoded token (MLX: its logits to the host; numpy: 0)
    step_s: float = 0.0  # a decoded token's fixed cost beyond its layers (sampling, bookkeeping, a compiled replay)
    read_byte_s: float = 0.0  # a read's cost per byte of its slot, beyond read_s (MLX on CUDA: managed memory)
    base_rss_streaming: int = 0  # a streaming run's base RSS (engine_fit.py); 0: base_rss for both kinds
    # the numpy engines' products when measured: COMPILED (Config.cpu_kernels, the kernels built
    # here) or FLOAT32 (numpy's widen + BLAS); "" on MLX. `expert` and the engine runs were
    # measured on these products, so a profile answers only for runs that use them.
    products: str = ""
    # stored dense type name -> seconds per compiled GEMV on the stored bytes, by stored bytes (a
    # type here is not widened: `widen` and `gemv` do not price it); empty: every dense matrix widened
    kernel_gemv: dict = field(default_factory=dict)
    # expert type name -> seconds per routed expert on its compiled kernel, by record bytes, for the
    # types other than the calibration model's (Q2_0, priced by `expert`)
    expert_kernels: dict = field(default_factory=dict)
    # the compiled kernels' threads every product and engine run was measured on (the count a run
    # computes with: strata.threads.kernel_threads); 0 on float32 products and MLX
    kernel_threads: int = 0

    @property
    def quick(self) -> bool:
        """Measured by the quick probe (probe.measure_machine(quick=True)), not the full one."""
        return any(n.startswith(QUICK_NOTE) for n in self.notes)

    def read_seconds(self, nbytes: int) -> float:
        return self.disk_latency_s + nbytes / self.disk_bytes_per_s

    def expert_seconds(self, record_bytes: float, qtype: str = "") -> float:
        """One routed expert in the engine: its in-engine cost at the calibration size, plus
        what the microbenchmark says a record of this size (and type `qtype`, where it has a
        compiled table of its own) costs beyond that one."""
        table = self.expert_kernels.get(qtype, self.expert)
        extra = table.each(record_bytes) - self.expert.each(self.calibration_record_bytes)
        return self.expert_call_s + max(0.0, extra)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["notes"] = list(self.notes)
        d["gemv"], d["expert"] = self.gemv.to_dict(), self.expert.to_dict()
        for name in ("widen", "kernel_gemv", "expert_kernels"):
            d[name] = {k: v.to_dict() for k, v in getattr(self, name).items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MachineProfile":
        d = dict(d)
        d["gemv"], d["expert"] = OpCost.from_dict(d["gemv"]), OpCost.from_dict(d["expert"])
        d["notes"] = tuple(d.get("notes", ()))
        for name in ("widen", "kernel_gemv", "expert_kernels"):
            d[name] = {k: OpCost.from_dict(v) for k, v in d.get(name, {}).items()}
        return cls(**d)


_PLACEHOLDER = MachineProfile(
    backend="", machine="", disk_latency_s=0.0, disk_bytes_per_s=1.0, disk_direct=False, mem_bytes_per_s=1.0,
    gemv=OpCost(((1.0, 0.0),)), expert=OpCost(((1.0, 0.0),)), expert_call_s=0.0, calibration_record_bytes=1,
    layer_s=0.0, turn_s=0.0, turn_slot_s=0.0, read_s=0.0, miss_s=0.0, calibration_slot_bytes=4096, base_rss=0,
    load_avg=0.0, measured_at=0.0)


def placeholder_profile(**fields) -> MachineProfile:
    """A profile holding only `fields` (the rest inert): for pricing ops before the engine is fitted."""
    return dataclasses.replace(_PLACEHOLDER, **fields)
