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
(KV cache, activations, read buffers, the interpreter's growth): PROCESS_RESERVE, or
SEED_KEEP_FRACTION of a machine too small for that. `dense_unwired` is the part of the dense
weights that sits in reclaimable file pages: 0 here (anonymous copies, already outside
`available` once loaded), and 0 by definition with `mlock_dense`. The rule never grows an arena
past its budget; it only decides a size once, at engine start.

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

__all__ = ["SizeSpec", "parse_size", "ArenaPlan", "plan_arena", "engine_arena_plan", "engine_min_slots", "keep_bytes", "mem_available", "cached_file_bytes",
           "model_cache_in_use", "fmt_bytes", "budget_bytes", "check_wired", "PROCESS_RESERVE"]

# What a run needs beyond its arena once the engine has started: measured 350-450 MB (peak RSS
# less the arena, numpy engine, a 24-layer 128-expert Q8_0 Qwen3-MoE under cgroup limits), with
# a margin. The rule used to keep SEED_KEEP_FRACTION of the machine (~29%: 7 GB of 24 GB), which
# at a 15% limit left no arena where the run fits.
PROCESS_RESERVE = 512 << 20
SEED_KEEP_FRACTION = 7 / 24  # the reference engine's 7 GB of a 24 GB Mac: the most "auto" keeps of a small machine


def keep_bytes(keep: str, total: int | None = None) -> int:
    """`keep` in bytes; "auto" is PROCESS_RESERVE, or SEED_KEEP_FRACTION of this machine's memory
    (`total`, default `machine_memory().total`: a container's limit where one is set) where that
    is less, so a small machine is not told to keep more than it has."""
    if keep == "auto":
        return min(PROCESS_RESERVE, int((machine_memory().total if total is None else total) * SEED_KEEP_FRACTION))
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

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes


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
               ple_bytes: int | None = None) -> ArenaPlan:
    """Decide the arena from `config.arena` or the budget rule (module docstring).

    An explicit size always streams (capped at one slot per expert: more can never be used),
    and is refused (ConfigError, one line) when it is above the budget unless
    `config.force_arena`; the budget rule streams only when the experts do not all fit. Raises
    ArenaTooSmallError when the size cannot hold one window's selections plus the read-ahead
    depth (`min_slots`). `available`, `total`, `active_file`: budget_bytes'. `wired_budget`: the GPU's wired ceiling ("auto": asked of MLX on a
    Mac, None elsewhere); a plan over it is refused by `check_wired`.
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
        _check(slots, min_slots, slot_bytes, reason)
        plan = ArenaPlan(True, slots, slot_bytes, min_slots, total_experts, reason)
    else:
        slots = max(0, budget) // slot_bytes
        if slots >= total_experts:
            plan = ArenaPlan(False, 0, slot_bytes, min_slots, total_experts, budget_reason + ": every expert fits")
        else:
            _check(slots, min_slots, slot_bytes, budget_reason)
            plan = ArenaPlan(True, slots, slot_bytes, min_slots, total_experts, budget_reason)
    check_wired(plan, dense_bytes, config, wired_budget)
    return plan


def engine_min_slots(config, *, moe_layers: int, top_k: int, n_experts: int) -> int:
    """The smallest legal arena of a streaming engine under `config` (the cache machine's
    `min_capacity` for its MoE layers, window, read-ahead depth and turn order)."""
    from strata.cache.types import min_capacity

    return min_capacity(moe_layers, top_k, config.prefetch, window=config.window, split_turn=config.split_turn,
                        prefetch2=config.prefetch2, n_experts=n_experts)


def engine_arena_plan(*, config, slot_bytes: int, moe_layers: int, top_k: int, n_experts: int, total_experts: int,
                      dense_bytes: int, model_files: tuple[Path, ...] = (), available: int | None = None,
                      total: int | None = None, active_file: int | None = None,
                      ple_bytes: int | None = None) -> ArenaPlan:
    """The plan a decoding engine runs (all-resident, or streaming on so many slots): `plan_arena`
    at `engine_min_slots`. The engines (strata.runtime.decode.arena_plan_for) and `strata doctor`
    both decide through this one function; the doctor passes the memory it predicts at engine
    start (available now less what loading takes)."""
    least = engine_min_slots(config, moe_layers=moe_layers, top_k=top_k, n_experts=n_experts)
    return plan_arena(config=config, slot_bytes=slot_bytes, total_experts=total_experts, min_slots=least,
                      dense_bytes=dense_bytes, model_files=model_files, available=available, total=total,
                      active_file=active_file, ple_bytes=ple_bytes)


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


def _check(slots: int, min_slots: int, slot_bytes: int, reason: str) -> None:
    if slots < min_slots:
        raise ArenaTooSmallError(
            f"arena of {slots} slots ({fmt_bytes(slots * slot_bytes)}, from {reason}) cannot hold one "
            f"window's selections of every layer plus the read-ahead depth: this configuration needs at "
            f"least {min_slots} slots ({fmt_bytes(min_slots * slot_bytes)}); give {option('arena', f'{min_slots}slots')} "
            f"or more, or lower {option('prefetch')}")
