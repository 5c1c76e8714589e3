"""Will it run here, and how fast: the arena the budget rule gives, the hit rate there, decode
tok/s and peak memory, from a source's byte budget and this machine's profile.

Decode time per token (seconds):

    resident:  step_s + n_layers · layer_s + ops + sync_s   (sync_s: the token's host round trip, MLX)
    streaming: resident + moe_layers · (turn_s + turn_slot_s · slots)
               + reads/token · (read_s + max(read_byte_s, 1 / disk bytes/s) · slot)
               + urgent misses/token · (miss_s + (slot − calibration slot) / disk bytes/s)

    ops = gemv(float32 calls, float32 dense bytes/token)   (seconds per call at the mean bytes per call)
          + kernel_gemv[type](dense calls − routers, stored bytes/token of that type)   (Q8_0 and Q6_K
            dense on the compiled CPU kernels: read as stored, never widened)
          + widen[type](dense GEMV calls, stored bytes/token of that type)   (the other stored types: numpy)
          + k · moe_layers · (expert_call_s + expert[type](record) − expert(calibration record))
          and never less than the token's bytes (`token_bytes`) at the measured memory bandwidth

The tables are the profile's, measured on the products the run will use (`profile.products`:
the compiled kernels under Config.cpu_kernels where they build, else numpy's float32 ones).

Peak memory: the process's base (measured) + the dense weights as held (as stored; on MLX twice:
the loader's copy and MLX's, `dense_held`) + every
expert (all-resident) or the arena (streaming) + the KV cache at `context`. The model file's
mapped pages are not added: measured peaks of the embedded and made models sit within 2-4% of
this sum and 6-16% below it with the file's size added (the map is let go as the copies fill).

The arena is the budget rule's as it will be at engine start: today's available memory less
what loading takes first (the base process and the dense weights), with the container's active
file pages, through `strata.runtime.budget.engine_arena_plan`, the function the engines decide
with, so `--arena`, `--keep`, the legal least and the refusals are a run's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from strata.doctor.byte_budget import COMPUTE_TYPE, ByteBudget, bytes_per_weight
from strata.doctor.families import PartCounts
from strata.doctor.locality import Locality, from_curve, from_trace
from strata.doctor.profile import MachineProfile
from strata.errors import StrataError
from strata.formats.quant_types import QuantType
from strata.runtime.budget import ArenaPlan, engine_arena_plan, engine_min_slots, fmt_bytes
from strata.runtime.memory import MemoryInfo

__all__ = ["Prediction", "predict", "ops_seconds", "token_bytes", "dense_held"]

ATTENTION_GEMVS = 4  # q, k, v, o per layer
SHARED_GEMVS = 3  # gate, up, down of a shared expert (or a dense MLP layer)


def dense_held(budget: ByteBudget, backend: str, gpu: bool | None = None) -> int:
    """Dense bytes a run holds: the loader's (as stored); on MLX also MLX's own copy (as stored,
    but float16 for an F32 file's matrices on a GPU's kernel path: about half its bytes)."""
    if backend != "mlx":
        return budget.dense_resident
    if gpu is None:
        from strata.engines import mlx_gpu_available

        gpu = mlx_gpu_available()
    f32_file = all(r.qtype == "F32" for r in budget.rows if r.part != "experts")
    return budget.dense_resident + (budget.dense_resident // 2 if gpu and f32_file else budget.dense_resident)


def _kernel_bytes(budget: ByteBudget, profile: MachineProfile) -> tuple[dict, int]:
    """(stored type -> stored bytes per token, their float32 bytes per token) of the dense types
    the profile's engine computes on compiled kernels (read as stored, never widened)."""
    kernel = {q: n for q, n in budget.widened_per_token.items() if q in profile.kernel_gemv}
    as_f32 = sum(int(n / bytes_per_weight(QuantType[q]) * bytes_per_weight(COMPUTE_TYPE)) for q, n in kernel.items())
    return kernel, as_f32


def token_bytes(budget: ByteBudget, profile: MachineProfile) -> int:
    """The bytes a decoded token reads: dense matrices on a compiled kernel as stored, the rest as
    float32 (what a widened matmul reads), the experts' records."""
    kernel, as_f32 = _kernel_bytes(budget, profile)
    return budget.per_token - as_f32 + sum(kernel.values())


def ops_seconds(counts: PartCounts, budget: ByteBudget, profile: MachineProfile) -> float:
    """The weight-reading part of one decoded token (module docstring)."""
    L, moe = counts.n_layers, counts.moe_layers
    calls = L * ATTENTION_GEMVS + moe + 1  # + routers + head
    if counts.dense.get("shared_expert"):
        calls += moe * SHARED_GEMVS
    if counts.dense.get("dense_ffn"):
        calls += (L - moe) * SHARED_GEMVS
    n_experts = moe * counts.top_k
    experts = n_experts * profile.expert_seconds(budget.expert_per_token / n_experts, budget.expert_qtype.name) \
        if n_experts else 0.0
    # dense matrices of a type with a compiled kernel: every call but the routers' (float32) reads them as stored
    kernel, as_f32 = _kernel_bytes(budget, profile)
    kernel_calls = calls - moe if kernel else 0
    on_kernel = sum(profile.kernel_gemv[q].seconds(kernel_calls, n) for q, n in kernel.items())
    # the other dense weights kept as stored are widened to float32 by every matmul that reads them
    widen = sum(profile.widen[q].seconds(calls, n) for q, n in budget.widened_per_token.items()
                if q in profile.widen and q not in kernel)
    return profile.gemv.seconds(calls - kernel_calls, budget.dense_per_token - as_f32) + on_kernel + experts + widen


@dataclass(frozen=True)
class Prediction:
    verdict: str  # "fits resident", "streams", "will not run", "not supported"
    summary: str  # one line for people
    backend: str
    streaming: bool
    arena_slots: int
    arena_bytes: int
    min_slots: int
    plan_reason: str
    locality: Locality | None
    token_s: float
    tok_per_s: float
    breakdown: dict = field(default_factory=dict)  # ms per token by term
    peak_memory: int = 0
    memory: dict = field(default_factory=dict)  # the machine's total / available and their source

    def to_dict(self) -> dict:
        d = asdict(self)
        d["locality"] = asdict(self.locality) if self.locality else None
        return d



def read_seconds(profile: MachineProfile, slot_bytes: int) -> float:
    """One expert read's cost to a token: the fitted per-read cost, its bytes at no more than the
    disk's measured bandwidth. The fit's per-byte term comes from the probe's 4 KiB slots, so on
    a model of megabyte slots it is an extrapolation: one quick probe here
    fitted 0 s a byte (1.7 MB read in 0.11 ms, 15 GB/s from a 0.9 GB/s disk) where another fitted
    8.5e-10 (about the disk's own 1/1.2 GB/s); the disk's rate keeps the first from pricing reads
    at memory speed (docs/doctor.md, "Under cgroup limits")."""
    return profile.read_s + max(profile.read_byte_s, 1.0 / profile.disk_bytes_per_s) * slot_bytes

def predict(*, counts: PartCounts, budget: ByteBudget, profile: MachineProfile, config, memory: MemoryInfo,
            supported: bool, why_not: str = "", model_files: tuple[Path, ...] = (), trace: Path | None = None,
            horizon: int = 0, prompt: int = 0, own_rss: int = 0) -> Prediction:
    """horizon 0: steady-state decode; N: the mean over a run of N tokens after `prompt` from a
    cold arena (what a short `strata generate` reports). own_rss: the asking process's resident
    bytes where `memory` was measured in it (0: `memory` is the run's, as given): the run's base
    process takes their place, so only the base beyond them is taken from `available`."""
    least = engine_min_slots(config, moe_layers=counts.moe_layers, top_k=counts.top_k, n_experts=counts.n_experts)
    base = profile.base_rss
    dense = dense_held(budget, profile.backend, gpu=profile.gpu)  # as on the machine the profile measured
    # the file's mapped pages are let go after load; the doctor's own process is gone by then
    after_load = memory.available - max(0, base - own_rss) - dense
    mem = {"total": memory.total, "available": memory.available, "source": memory.source,
           "available_at_engine_start": after_load}
    plan: ArenaPlan | None = None
    refusal = ""
    try:
        plan = engine_arena_plan(config=config, slot_bytes=budget.slot_bytes, moe_layers=counts.moe_layers,
                                 top_k=counts.top_k, n_experts=counts.n_experts, total_experts=budget.total_experts,
                                 dense_bytes=budget.dense_resident, model_files=model_files, available=after_load,
                                 total=memory.total, active_file=memory.active_file,
                                 ple_bytes=budget.ple_reserve or None, synchronous=profile.backend == "numpy")
    except StrataError as e:
        refusal = str(e)
    if plan is not None:  # a short arena's fitted knobs: the run's read-ahead depth, pins and least
        config, least = plan.applied(config), plan.min_slots
    streaming = plan.streaming if plan else True
    slots = plan.slots if plan and plan.streaming else (0 if plan else least)
    locality = None
    if streaming:
        if trace is not None:
            locality = from_trace(trace, config, slots, horizon=horizon, prompt=prompt)
        else:
            locality = from_curve(slots / max(budget.total_experts, 1), counts.moe_layers * counts.top_k,
                                  fill_per_token=slots / (prompt + horizon) if horizon else 0.0)
    # never faster than reading the bytes once at the measured memory bandwidth
    ops = max(ops_seconds(counts, budget, profile), token_bytes(budget, profile) / profile.mem_bytes_per_s)
    terms = {"step": profile.step_s, "layers": counts.n_layers * profile.layer_s, "weights": ops,
             "round_trip": profile.sync_s}
    if streaming and locality is not None:
        miss = profile.miss_s + (budget.slot_bytes - profile.calibration_slot_bytes) / profile.disk_bytes_per_s
        terms["turns"] = counts.moe_layers * (profile.turn_s + profile.turn_slot_s * slots)
        terms["reads"] = locality.reads_per_token * read_seconds(profile, budget.slot_bytes)
        terms["urgent_waits"] = locality.urgent_per_token * max(miss, 0.0)
    token_s = sum(terms.values())
    experts_held = plan.nbytes if plan and plan.streaming else budget.experts_resident
    # the arena's room was planned against the larger (resident) base: a plan never counts on less
    held_base = profile.base_rss_streaming if streaming and profile.base_rss_streaming else base
    peak = held_base + dense + experts_held + budget.kv_bytes + budget.ple_reserve
    tps = 1.0 / token_s if token_s > 0 else 0.0
    arena_txt = f"arena {slots} slots ({fmt_bytes(slots * budget.slot_bytes)})"
    if not supported:
        verdict = "not supported"
        how = f"streams at ~{tps:.3g} tok/s ({arena_txt})" if streaming else f"fits resident at ~{tps:.3g} tok/s"
        summary = f"not supported by this version yet ({why_not}); " + (
            f"and here it would not run: {refusal}" if refusal else f"if it ran: {how}")
    elif refusal:
        verdict, summary = "will not run", f"will not run here: {refusal}"
    elif streaming:
        verdict = "streams"
        summary = (f"streams at {tps:.3g} tok/s: {arena_txt}, hit rate {100 * locality.hit_rate:.1f}%, "
                   f"{locality.urgent_per_token:.2f} urgent misses/token")
    else:
        verdict, summary = "fits resident", f"fits resident: {tps:.3g} tok/s, peak {fmt_bytes(peak)}"
    reason = (plan.reason + (f"; {plan.knobs}" if plan.knobs else "")) if plan else refusal
    return Prediction(verdict=verdict, summary=summary, backend=profile.backend, streaming=streaming,
                      arena_slots=slots, arena_bytes=slots * budget.slot_bytes, min_slots=least,
                      plan_reason=reason, locality=locality, token_s=token_s,
                      tok_per_s=tps, breakdown={k: 1e3 * v for k, v in terms.items()}, peak_memory=peak, memory=mem)
