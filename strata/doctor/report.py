"""The doctor's answer: one dataclass (`Diagnosis`), its text for people and its JSON for tools."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from strata.doctor.byte_budget import ByteBudget, byte_budget
from strata.doctor.families import PartCounts
from strata.doctor.predict import Prediction, predict
from strata.doctor.probe import first_answer_profile, machine_profile
from strata.doctor.profile import MachineProfile
from strata.doctor.source import Source, read_source
from strata.doctor.tier2 import Tier2Diagnosis
from strata.formats.quant_types import QuantType
from strata.runtime.budget import fmt_bytes
from strata.runtime.memory import MemoryInfo, machine_memory

__all__ = ["Diagnosis", "diagnose"]

DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class Diagnosis:
    source: Source
    budget: ByteBudget
    profile: MachineProfile
    prediction: Prediction
    tier2: Tier2Diagnosis | None = None  # a checkpoint directory tier 2 can run here (strata.doctor.tier2)

    @property
    def counts(self) -> PartCounts:
        return self.source.counts

    def text(self) -> str:
        c, b, p, m = self.counts, self.budget, self.prediction, self.profile
        lines = [f"{self.source.path}: {c.family} ({c.model_type}), {c.n_layers} layers ({c.moe_layers} MoE), "
                 f"{c.n_experts} experts top-{c.top_k}, {_count(c.total_weights)} weights, "
                 f"{_count(c.active_weights)} active per token"
                 + (f"; {self.source.note}" if self.source.note else "")]
        lines.append("bytes per token (as strata holds them):")
        for r in b.rows:
            lines.append(f"  {r.part:<14} {r.qtype:<5} {r.weights / 1e6:12.2f}M weights  resident "
                         f"{fmt_bytes(r.resident_bytes):>10}  per token {fmt_bytes(r.per_token_bytes):>10}")
        lines.append(f"  total per token {fmt_bytes(b.per_token)} (dense {fmt_bytes(b.dense_per_token)} + "
                     f"{c.top_k} x {c.moe_layers} experts {fmt_bytes(b.expert_per_token)}); one expert "
                     f"{fmt_bytes(b.record_bytes)}, slot {fmt_bytes(b.slot_bytes)}")
        if b.ple_reserve:
            lines.append(f"  PLE rows from the row store: {c.ple_rows_per_token} rows of {c.ple_row_width} per token "
                         f"({fmt_bytes(b.ple_per_token)}), never resident; row cache (ple_reserve) "
                         f"{fmt_bytes(b.ple_reserve)} in memory")
        if self.source.stored:
            lines.append("  as stored: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.source.stored.items()))
        if self.source.in_place:
            lines.append(_in_place_line(self.source, c.top_k * c.moe_layers))
        lines.append(f"memory all-resident: {fmt_bytes(b.all_resident)} (dense {fmt_bytes(b.dense_resident)} as stored "
                     f"+ experts {fmt_bytes(b.experts_resident)} + KV {fmt_bytes(b.kv_bytes)} at {b.context} positions"
                     + (f" + PLE row cache {fmt_bytes(b.ple_reserve)}" if b.ple_reserve else "") + ")")
        mem = p.memory
        lines.append(f"this machine: {fmt_bytes(mem['total'])} total, {fmt_bytes(mem['available'])} available "
                     f"({mem['source']}); disk {m.disk_latency_s * 1e6:.0f} us/4 KiB, "
                     f"{fmt_bytes(m.disk_bytes_per_s)}/s; memory {fmt_bytes(m.mem_bytes_per_s)}/s; "
                     f"backend {m.backend}" + (f", {m.products} products" if m.products else "")
                     + (f" on {m.kernel_threads} kernel thread{'s' if m.kernel_threads > 1 else ''}"
                        if m.kernel_threads else "")
                     + f" (profile measured at load {m.load_avg:.1f}"
                     + ("; the quick probe's: `strata doctor --calibrate` measures fully, for the documented error)"
                        if m.quick else ")"))
        t2 = self.tier2
        if t2 is not None and t2.verdict != "not supported":  # `strata generate DIR` runs tier 2: its plan, verdict
            lines.append(t2.why)
            lines += t2.lines()
            if _needs_convert(self.source) and p.verdict != "not supported":
                lines.append(f"native path (once converted with `strata convert`): {p.summary}")
            return "\n".join(lines)
        lines.append(f"arena: {p.arena_slots} slots ({fmt_bytes(p.arena_bytes)}; at least {p.min_slots}) from "
                     f"{p.plan_reason}" if p.streaming else f"arena: none needed ({p.plan_reason})")
        if p.locality is not None:
            loc = p.locality
            spread = f" +- {loc.spread:.2f}" if loc.spread else ""
            lines.append(f"expected: hit rate {100 * loc.hit_rate:.2f}%, {loc.urgent_per_token:.2f}{spread} urgent "
                         f"misses/token, {loc.reads_per_token:.1f} reads/token ({loc.source})")
        terms = ", ".join(f"{k} {v:.2f}" for k, v in p.breakdown.items())
        lines.append(f"predicted decode: {p.tok_per_s:.3g} tok/s ({1e3 * p.token_s:.2f} ms/token: {terms}); "
                     f"peak memory {fmt_bytes(p.peak_memory)}")
        after = " (once converted with `strata convert`)" if _needs_convert(self.source) and p.verdict != "not supported" else ""
        lines.append(f"verdict: {p.summary}{after}")
        if self.source.kind in ("hf", "mlx"):  # a checkpoint directory may run as it is (tier 2, docs/tier2.md)
            lines.append(_tier_line(self.source))
            if t2 is not None:
                lines.append(t2.summary)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        s = self.source
        return {
            "source": s.path, "kind": s.kind, "family": s.counts.family, "model_type": s.counts.model_type,
            "supported": s.counts.supported, "why_not": s.counts.why_not, "note": s.note,
            "weights": {"total": s.counts.total_weights, "active": s.counts.active_weights,
                        "dense": s.counts.dense_weights, "expert_each": s.counts.expert_weights},
            "shape": {"n_layers": s.counts.n_layers, "moe_layers": s.counts.moe_layers,
                      "n_experts": s.counts.n_experts, "top_k": s.counts.top_k, "hidden": s.counts.hidden},
            "bytes": {"rows": [asdict(r) for r in self.budget.rows], "per_token": self.budget.per_token,
                      "dense_per_token": self.budget.dense_per_token, "expert_per_token": self.budget.expert_per_token,
                      "ple_per_token": self.budget.ple_per_token, "ple_reserve": self.budget.ple_reserve,
                      "record": self.budget.record_bytes, "slot": self.budget.slot_bytes,
                      "all_resident": self.budget.all_resident, "dense_resident": self.budget.dense_resident,
                      "experts_resident": self.budget.experts_resident, "kv": self.budget.kv_bytes,
                      "context": self.budget.context, "stored": s.stored, "expert_qtype": self.budget.expert_qtype.name,
                      "in_place": s.in_place or None},
            "machine": self.profile.to_dict(),
            "prediction": self.prediction.to_dict(),
            "tier2": None if self.tier2 is None else self.tier2.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _in_place_line(source: Source, selections: int) -> str:
    """A llama.cpp GGUF: its experts read in place against the converted records (reads, bytes)."""
    ip = source.in_place
    here, converted = ip["read_bytes_per_record"], ip["converted_bytes_per_record"]
    return (f"  in place (`strata generate {source.path}`, nothing converted): {ip['reads_per_record']:.1f} reads per "
            f"expert ({100 * ip['multi_read_share']:.0f}% of experts need more than one), {fmt_bytes(here)} read per "
            f"expert; converted (`strata convert`): 1 read of {fmt_bytes(converted)}; with every selection a miss "
            f"{fmt_bytes(here * selections)}/token in place vs {fmt_bytes(converted * selections)}/token converted")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _directory(source: Source) -> Path:
    where = Path(source.path)
    return where if where.is_dir() else where.parent


def _tier_line(source: Source) -> str:
    from strata.convert.architectures import BY_MODEL_TYPE
    from strata.tier2.source import tier_line

    t = source.counts.model_type
    return tier_line(_directory(source), t, t in BY_MODEL_TYPE)


def _tier2(source: Source, config, memory: MemoryInfo, profile: MachineProfile) -> Tier2Diagnosis | None:
    """Tier 2's plan for a checkpoint directory it can run here (mlx-lm importable, with a model
    file for its model_type); None for anything else."""
    from strata.errors import ConfigError
    from strata.tier2.source import is_tier2_source, require_mlx_lm, tier2_has

    where = _directory(source)
    if source.kind not in ("hf", "mlx") or not is_tier2_source(where) or not tier2_has(source.counts.model_type):
        return None
    why = _tier_line(source)
    try:
        require_mlx_lm(where)
    except ConfigError as e:
        return Tier2Diagnosis("not supported", f"not supported on tier 2: {e}", why)
    from strata.doctor.tier2 import diagnose_tier2

    return diagnose_tier2(where, config=config, memory=memory, base_rss=profile.base_rss, why=why)


def _needs_convert(source: Source) -> bool:
    return source.kind == "hf"


def resolve_backend(config, expert_qtype: QuantType) -> str:
    """The backend a run would get (`strata.engines.resolve_backend`'s rule, before loading)."""
    from strata.config import Backend
    from strata.engines import mlx_gpu_available

    if config.backend is not Backend.AUTO:
        return config.backend.value
    if not mlx_gpu_available() or expert_qtype is None:
        return "numpy"
    from strata.formats.expert_record import RecordLayout
    from strata.mlx_backend.experts import fused_refusal

    block = 256  # a shape every kernel type divides (K / IQ super-blocks), so only the type decides
    return "mlx" if fused_refusal(RecordLayout(expert_qtype, block, block)) is None else "numpy"


def diagnose(source: str | Path, *, cache_dir: Path, config=None, trace: str | Path | None = None,
             expert_qtype: QuantType = QuantType.Q2_0, dense_qtype: QuantType = QuantType.F32,
             context: int | None = None, profile: MachineProfile | None = None, memory: MemoryInfo | None = None,
             remeasure: bool = False, progress=None, horizon: int = 0, prompt: int = 0,
             quick: bool = False) -> Diagnosis:
    """Everything `strata doctor` prints, for SOURCE on this machine (or the given profile and
    memory figures: tests and what-if questions). horizon / prompt: predict the mean over a
    run of `horizon` tokens after a `prompt`-token prompt (0: the steady state). `quick`:
    answer from a calibrated (full) profile where one is cached, else from the quick probe
    (probe.first_answer_profile); otherwise from the full probe, measured now if needed."""
    from strata.config import Config

    config = config or Config()
    src = read_source(source, expert_qtype=expert_qtype, dense_qtype=dense_qtype, trace=trace)
    cfg = src.counts.model_config
    ctx = context or min(DEFAULT_CONTEXT, getattr(cfg, "max_context", DEFAULT_CONTEXT))
    budget = byte_budget(src.counts, expert_qtype=src.expert_qtype, dense_qtype=src.dense_qtype, context=ctx,
                         slot_bytes=src.slot_bytes)
    if src.kind == "strata":  # its tensor index says exactly what the loader will hold (dense kept as stored)
        budget = dataclasses.replace(budget, dense_resident=src.stored["dense"], dense_file=src.stored["dense"])
    backend = resolve_backend(config, src.expert_qtype)
    if profile is None and quick:
        profile = first_answer_profile(backend, cache_dir, remeasure=remeasure, progress=progress,
                                       cpu_kernels=config.cpu_kernels, threads=config.threads)
    profile = profile or machine_profile(backend, cache_dir, remeasure=remeasure, progress=progress,
                                         cpu_kernels=config.cpu_kernels, threads=config.threads)
    # measured here: this process's own memory is counted as used, and the run replaces it
    own_rss = 0 if memory is not None else _own_rss()
    memory = memory or machine_memory()
    pred = predict(counts=src.counts, budget=budget, profile=profile, config=config, memory=memory,
                   supported=src.counts.supported and src.kind != "mlx",
                   why_not=src.note if src.kind == "mlx" else src.counts.why_not,
                   model_files=src.model_files, trace=src.trace, horizon=horizon, prompt=prompt, own_rss=own_rss)
    return Diagnosis(src, budget, profile, pred, _tier2(src, config, memory, profile))


def _own_rss() -> int:
    """This process's resident bytes (psutil), 0 where they cannot be read."""
    import psutil

    try:
        return int(psutil.Process().memory_info().rss)
    except (psutil.Error, OSError):
        return 0
