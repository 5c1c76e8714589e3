"""How many arena slots a run gets (design §7): `--arena SIZE` or the budget rule.

    arena = available + model page cache − keep − ple_reserve − dense_unwired

`available` is the kernel's MemAvailable (a container's limit less what it uses but inactive
file pages). The page cache holding the model's own files is the arena's to take: strata's
loader copies the dense tensors into anonymous memory and the experts are read into the arena,
so those file pages are never needed again; the loader has just read the model file, and
charging its cache against the arena refused runs that fit (a 15% limit on a 5.3 GB model).
psutil's MemAvailable already counts that cache as available; inside a container limit, the
model's pages among the active file pages (which `available` counts as used) are added back
(`model_cache_in_use`: min(the model files' cached bytes, the cgroup's active file bytes)).
`keep` ("auto") is what the process itself still needs beyond its arena once the engine starts
(KV cache, activations, read buffers, the interpreter's growth): RESERVE_SHARE of the machine,
at least the measured PROCESS_GROWTH, at most PROCESS_RESERVE (`keep_bytes`). `dense_unwired`
is the part of the dense weights that sits in reclaimable file pages: 0 here (anonymous copies,
already outside `available` once loaded), and 0 by definition with `mlock_dense`. The rule never
grows an arena past its budget; it only decides a size once, at engine start. A budget arena
below the settings' least is fitted where a shallower read-ahead or (a synchronous backend)
decode pins of one layer let it run (`fit_knobs`); the plan's `knobs` line says which.

Memory figures come from `strata.runtime.memory.machine_memory` (psutil, bounded by a container's
cgroup limit: inside a container the limit is the machine). An explicit `--arena` above the
budget is refused in one line unless `force_arena`; on a Mac's GPU a plan whose wired bytes
(arena + dense weights) exceed `max_recommended_working_set_size` is refused with the numbers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from strata.errors import ArenaTooSmallError, ConfigError
from strata.sizes import SizeSpec, fmt_bytes, parse_size
from strata.runtime.memory import machine_memory, metal_wired_budget
from strata.option_names import option

__all__ = ["SizeSpec", "parse_size", "ArenaPlan", "KnobFit", "fit_knobs", "plan_arena", "engine_arena_plan",
           "engine_min_slots", "keep_bytes", "mem_available", "cached_file_bytes", "model_cache_in_use", "fmt_bytes",
           "budget_bytes", "check_wired", "PROCESS_RESERVE", "PROCESS_GROWTH", "RESERVE_SHARE"]

# What a run needs beyond its arena once the engine has started (the process's growth after the
# budget was taken: compiled kernels, reader buffers, a prompt chunk's activations and widened
# experts, the KV cache of a short run). Measured as peak RSS less the RSS after loading less the
# arena: 27-31 MB (numpy engine, compiled kernels, 32 prompt + 16 decode tokens, a 16-layer
# 64-expert D 1024 Qwen3-MoE, Q4_0 and Q8_0, under cgroup limits of 137-506 MiB); PROCESS_GROWTH
# is that with a margin. On a large machine PROCESS_RESERVE (350-450 MB measured as peak RSS less
# the arena, dense weights included, on a 24-layer 128-expert Q8_0 model) caps the reserve; between
# the two a share of the machine, RESERVE_SHARE (8 GiB's 512 MiB). The rule used to keep 7/24 of a
# small machine (84 MB at a 276 MiB limit), which refused runs that fit.
PROCESS_RESERVE = 512 << 20
PROCESS_GROWTH = 40 << 20
RESERVE_SHARE = 1 / 16


def keep_bytes(keep: str, total: int | None = None) -> int:
    """`keep` in bytes; "auto" is RESERVE_SHARE of this machine's memory (`total`, default
    `machine_memory().total`: a container's limit where one is set), at least PROCESS_GROWTH and
    at most PROCESS_RESERVE."""
    if keep == "auto":
        share = int((machine_memory().total if total is None else total) * RESERVE_SHARE)
        return min(PROCESS_RESERVE, max(PROCESS_GROWTH, share))
    return parse_size(keep, what="keep", allow_slots=False).nbytes


def mem_available() -> int:
    """What a run can take now: psutil's available memory, bounded by a container's limit."""
    return machine_memory().available


def cached_file_bytes(path: str | os.PathLike) -> int:
    """Bytes of `path` in the page cache (mincore over a private map); 0 where that fails."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        size = os.path.getsize(path)
        if size == 0:
            return 0
        page = mmap.PAGESIZE
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                return 0
            resident = sum(b & 1 for b in bytes(vec))
            del addr
        return min(size, resident * page)
    except (OSError, ValueError, AttributeError, TypeError, BufferError):
        return 0


@dataclass(frozen=True)
class ArenaPlan:
    """The arena a run gets. `streaming` False: every expert fits, the all-resident engine runs."""

    streaming: bool
    slots: int  # arena slots (0 when not streaming)
    slot_bytes: int
    min_slots: int  # the smallest legal arena for this configuration
    total_experts: int  # n_layers * n_experts
    reason: str  # one line: where the size came from
    # the budget rule's fit when the arena is short (`fit_knobs`): the read-ahead depth and pin
    # scope the run takes instead of the configuration's, and the line that says so (empty: none)
    prefetch: int | None = None
    layer_pins: bool = False
    knobs: str = ""

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def applied(self, config):
        """`config` with the knobs this plan changed (itself when it changed none)."""
        if not self.knobs:
            return config
        return config.replace(prefetch=self.prefetch, layer_pins=self.layer_pins)


@dataclass(frozen=True)
class KnobFit:
    """One way to run a short arena: its smallest legal arena under `prefetch` and `layer_pins`."""

    min_slots: int
    prefetch: int
    layer_pins: bool


def model_cache_in_use(model_files: tuple[Path, ...], active_file: int) -> int:
    """The model files' page cache that `available` counts as used: at most the container's
    active file pages (`active_file`; 0 where `available` counts the page cache as available)."""
    if active_file <= 0:
        return 0
    return min(active_file, sum(cached_file_bytes(p) for p in model_files))


def budget_bytes(config, *, model_files: tuple[Path, ...] = (), available: int | None = None,
                 total: int | None = None, active_file: int | None = None,
                 ple_bytes: int | None = None) -> tuple[int, str]:
    """The budget rule (module docstring): the bytes an arena may take now, and the one-line sum.
    active_file: the file pages `available` counts as used (MemoryInfo.active_file; None: this
    machine's where `available` is measured here, else 0). ple_bytes: the row cache of a model
    with PLE rows (strata.runtime.ngram_budget), which may differ from `config.ple_reserve` (its
    default when unset); None: `config.ple_reserve`."""
    if available is None or total is None:
        mem = machine_memory()
        if available is None:
            available, active_file = mem.available, mem.active_file if active_file is None else active_file
        total = mem.total if total is None else total
    model_cache = model_cache_in_use(model_files, active_file or 0)
    keep = keep_bytes(config.keep, total)
    ple = parse_size(config.ple_reserve or "0", what="ple_reserve", allow_slots=False).nbytes if ple_bytes is None \
        else ple_bytes
    dense_unwired = 0  # see the module docstring: dense tensors are anonymous copies
    budget = available + model_cache - keep - ple - dense_unwired
    reason = (f"budget: available {fmt_bytes(available)} + model page cache {fmt_bytes(model_cache)} - keep "
              f"{fmt_bytes(keep)} - ple {fmt_bytes(ple)} - dense unwired {fmt_bytes(dense_unwired)} "
              f"= {fmt_bytes(budget)}")
    return budget, reason


def plan_arena(*, config, slot_bytes: int, total_experts: int, min_slots: int,
               dense_bytes: int, model_files: tuple[Path, ...] = (), available: int | None = None,
               total: int | None = None, active_file: int | None = None, wired_budget: int | None | str = "auto",
               ple_bytes: int | None = None, fits: tuple[KnobFit, ...] = ()) -> ArenaPlan:
    """Decide the arena from `config.arena` or the budget rule (module docstring).

    An explicit size always streams (capped at one slot per expert: more can never be used),
    and is refused (ConfigError, one line) when it is above the budget unless
    `config.force_arena`; the budget rule streams only when the experts do not all fit. Raises
    ArenaTooSmallError when the size cannot hold one window's selections plus the read-ahead
    depth (`min_slots`), unless the budget rule's arena holds one of `fits` (in order: the first
    that fits is taken and named in the plan's `knobs`). `available`, `total`, `active_file`:
    budget_bytes'. `wired_budget`: the GPU's wired ceiling ("auto": asked of MLX on a Mac, None
    elsewhere); a plan over it is refused by `check_wired`.
    """
    budget, budget_reason = budget_bytes(config, model_files=model_files, available=available, total=total,
                                         active_file=active_file, ple_bytes=ple_bytes)
    if config.arena:
        spec = parse_size(config.arena, what="arena")
        slots = spec.to_slots(slot_bytes, total_experts)
        reason = option("arena", config.arena)
        if slots > max(total_experts, min_slots):
            slots = max(total_experts, min_slots)
            reason += f" (capped at {slots} slots: one per expert)"
        if slots * slot_bytes > budget and not config.force_arena:
            raise ConfigError(f"{option('arena', config.arena)} ({fmt_bytes(slots * slot_bytes)}) is above this "
                              f"machine's {budget_reason}; give a smaller {option('arena')}, or "
                              f"{option('force_arena', True)} to run it anyway")
        _check(slots, min_slots, slot_bytes, reason, _least_clause(fits, slot_bytes))
        plan = ArenaPlan(True, slots, slot_bytes, min_slots, total_experts, reason)
    else:
        slots = max(0, budget) // slot_bytes
        fit = next((f for f in fits if f.min_slots <= slots), None) if slots < min_slots else None
        if slots >= total_experts:
            plan = ArenaPlan(False, 0, slot_bytes, min_slots, total_experts, budget_reason + ": every expert fits")
        elif fit is not None:
            plan = ArenaPlan(True, slots, slot_bytes, fit.min_slots, total_experts, budget_reason, fit.prefetch,
                             fit.layer_pins, _knobs_line(config, fit, slots, min_slots))
        else:
            _check(slots, min_slots, slot_bytes, budget_reason, _least_clause(fits, slot_bytes))
            plan = ArenaPlan(True, slots, slot_bytes, min_slots, total_experts, budget_reason)
    check_wired(plan, dense_bytes, config, wired_budget)
    return plan


def engine_min_slots(config, *, moe_layers: int, top_k: int, n_experts: int, prefetch: int | None = None,
                     layer_pins: bool | None = None) -> int:
    """The smallest legal arena of a streaming engine under `config` (the cache machine's
    `min_capacity` for its MoE layers, window, read-ahead depth and turn order); `prefetch`,
    `layer_pins`: instead of the configuration's."""
    from strata.cache.types import min_capacity

    return min_capacity(moe_layers, top_k, config.prefetch if prefetch is None else prefetch, window=config.window,
                        split_turn=config.split_turn, prefetch2=config.prefetch2, n_experts=n_experts,
                        layer_pins=config.layer_pins if layer_pins is None else layer_pins)


def fit_knobs(config, *, moe_layers: int, top_k: int, n_experts: int, synchronous: bool) -> tuple[KnobFit, ...]:
    """How a budget-rule arena shorter than the configuration's least may still run, best first:
    a synchronous backend's compute of a layer is over before the next layer's turn, so its
    decode pins may last one layer (`layer_pins`: one layer's selections resident, not every
    layer's) at the configured read-ahead depth; then the depth lowered one step at a time to 0.
    An asynchronous backend (MLX: a window's layers are one command buffer) keeps its window pins
    and only lowers the depth."""
    pins = synchronous or config.layer_pins  # window pins never need less than layer pins at one depth
    return tuple(KnobFit(engine_min_slots(config, moe_layers=moe_layers, top_k=top_k, n_experts=n_experts,
                                          prefetch=k, layer_pins=pins), k, pins)
                 for k in range(config.prefetch, -1, -1) if (k, pins) != (config.prefetch, config.layer_pins))


def _knobs_line(config, fit: KnobFit, slots: int, least: int) -> str:
    """The report's line for a fitted plan: which knob changed and why."""
    changed = []
    if fit.layer_pins != config.layer_pins:
        changed.append("decode pins last one layer (layer_pins on)")
    if fit.prefetch != config.prefetch:
        changed.append(f"read-ahead depth {config.prefetch} -> {fit.prefetch} (prefetch)")
    return (f"arena short: the budget holds {slots} slots where these settings need {least}; "
            f"{' and '.join(changed)}, which need {fit.min_slots}")


def engine_arena_plan(*, config, slot_bytes: int, moe_layers: int, top_k: int, n_experts: int, total_experts: int,
                      dense_bytes: int, model_files: tuple[Path, ...] = (), available: int | None = None,
                      total: int | None = None, active_file: int | None = None,
                      ple_bytes: int | None = None, synchronous: bool | None = None) -> ArenaPlan:
    """The plan a decoding engine runs (all-resident, or streaming on so many slots): `plan_arena`
    at `engine_min_slots`. The engines (strata.runtime.decode.arena_plan_for) and `strata doctor`
    both decide through this one function; the doctor passes the memory it predicts at engine
    start (available now less what loading takes). synchronous: whether the backend finishes a
    layer's compute before the next layer's turn (numpy), which lets a short arena be fitted
    (`fit_knobs`); None: no fitting (a caller that does not apply the plan's knobs)."""
    least = engine_min_slots(config, moe_layers=moe_layers, top_k=top_k, n_experts=n_experts)
    fits = () if synchronous is None else fit_knobs(config, moe_layers=moe_layers, top_k=top_k,
                                                      n_experts=n_experts, synchronous=synchronous)
    return plan_arena(config=config, slot_bytes=slot_bytes, total_experts=total_experts, min_slots=least,
                      dense_bytes=dense_bytes, model_files=model_files, available=available, total=total,
                      active_file=active_file, ple_bytes=ple_bytes, fits=fits)


def check_wired(plan: ArenaPlan, dense_bytes: int, config, wired_budget: int | None | str = "auto") -> None:
    """Refuse a plan whose wired bytes exceed the GPU's ceiling (Apple silicon: the arena, or
    every expert when all-resident, plus the dense weights). Applies where a ceiling exists and
    the backend may be MLX; `force_arena` lets it through (the system then pages)."""
    from strata.config import Backend  # late: config imports this module

    if config.backend is Backend.NUMPY or config.force_arena:
        return
    ceiling = metal_wired_budget() if wired_budget == "auto" else wired_budget
    if ceiling is None:
        return
    experts = plan.nbytes if plan.streaming else plan.total_experts * plan.slot_bytes
    wired = experts + dense_bytes
    if wired > ceiling:
        raise ConfigError(
            f"plan refused: it wires {fmt_bytes(wired)} (experts {fmt_bytes(experts)} + dense {fmt_bytes(dense_bytes)}) "
            f"but this GPU may keep at most {fmt_bytes(ceiling)} wired (max_recommended_working_set_size); "
            f"give a smaller {option('arena')}, or {option('force_arena', True)} "
            "to run it anyway")


def _least_clause(fits: tuple[KnobFit, ...], slot_bytes: int) -> str:
    """A refusal's clause naming the smallest arena any fit runs on ('' without fits)."""
    least = min(fits, key=lambda f: f.min_slots, default=None)
    if least is None:
        return ""
    return (f"; the least this backend runs: {least.min_slots} slots ({fmt_bytes(least.min_slots * slot_bytes)}) "
            f"with {option('prefetch', least.prefetch)}" + (f" and {_layer_pins_on()}" if least.layer_pins else ""))


def _layer_pins_on() -> str:
    """layer_pins has no flag of its own: `--set layer_pins=on` on the command line."""
    spelled = option("set", "layer_pins=on")
    return spelled if spelled.startswith("--") else option("layer_pins", True)


def _check(slots: int, min_slots: int, slot_bytes: int, reason: str, fitted: str = "") -> None:
    """Refuse an arena below `min_slots`; fitted: a clause naming the least a fitted plan needs."""
    if slots < min_slots:
        raise ArenaTooSmallError(
            f"arena of {slots} slots ({fmt_bytes(slots * slot_bytes)}, from {reason}) cannot hold one "
            f"window's selections of every layer plus the read-ahead depth: this configuration needs at "
            f"least {min_slots} slots ({fmt_bytes(min_slots * slot_bytes)}); give {option('arena', f'{min_slots}slots')} "
            f"or more, or lower {option('prefetch')}{fitted}")
