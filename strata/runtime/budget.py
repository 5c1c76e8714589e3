"""How many arena slots a run gets (design §7): `--arena SIZE` or the budget rule.

    arena = available − keep − ple_reserve − dense_unwired

`available` is the kernel's MemAvailable less the page cache already holding the model's own
files (the design: "inactive file pages of the model itself are not available" — they are what the
arena would displace). `dense_unwired` is the part of the dense weights that sits in
reclaimable file pages: strata's loader copies dense tensors into anonymous memory (already
outside MemAvailable once loaded), so it is 0 here, and 0 by definition with `mlock_dense`.
The rule never grows an arena past its budget; it only decides a size once, at engine start.

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

__all__ = ["SizeSpec", "parse_size", "ArenaPlan", "plan_arena", "keep_bytes", "mem_available", "cached_file_bytes",
           "fmt_bytes", "budget_bytes", "check_wired"]

SEED_KEEP_FRACTION = 7 / 24  # the reference engine: keep = 7 GB on a 24 GB Mac


def keep_bytes(keep: str, total: int | None = None) -> int:
    """`keep` in bytes; "auto" scales the reference engine's 7 GB of 24 GB to this machine's memory (`total`,
    default `machine_memory().total`: a container's limit where one is set), so a small machine
    is not told to keep more than it has."""
    if keep == "auto":
        return int((machine_memory().total if total is None else total) * SEED_KEEP_FRACTION)
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


def budget_bytes(config, *, model_files: tuple[Path, ...] = (), available: int | None = None,
                 total: int | None = None, ple_bytes: int | None = None) -> tuple[int, str]:
    """The budget rule (module docstring): the bytes an arena may take now, and the one-line sum.
    ple_bytes: the row cache of a model with PLE rows (strata.runtime.ngram_budget), which may
    differ from `config.ple_reserve` (its default when unset); None: `config.ple_reserve`."""
    if available is None or total is None:
        mem = machine_memory()
        available = mem.available if available is None else available
        total = mem.total if total is None else total
    cached = sum(cached_file_bytes(p) for p in model_files)
    keep = keep_bytes(config.keep, total)
    ple = parse_size(config.ple_reserve or "0", what="ple_reserve", allow_slots=False).nbytes if ple_bytes is None \
        else ple_bytes
    dense_unwired = 0  # see the module docstring: dense tensors are anonymous copies
    budget = available - cached - keep - ple - dense_unwired
    reason = (f"budget: available {fmt_bytes(available)} - model page cache {fmt_bytes(cached)} - keep "
              f"{fmt_bytes(keep)} - ple {fmt_bytes(ple)} - dense unwired {fmt_bytes(dense_unwired)} "
              f"= {fmt_bytes(budget)}")
    return budget, reason


def plan_arena(*, config, slot_bytes: int, total_experts: int, min_slots: int,
               dense_bytes: int, model_files: tuple[Path, ...] = (), available: int | None = None,
               total: int | None = None, wired_budget: int | None | str = "auto",
               ple_bytes: int | None = None) -> ArenaPlan:
    """Decide the arena from `config.arena` or the budget rule (module docstring).

    An explicit size always streams (capped at one slot per expert: more can never be used),
    and is refused (ConfigError, one line) when it is above the budget unless
    `config.force_arena`; the budget rule streams only when the experts do not all fit. Raises
    ArenaTooSmallError when the size cannot hold one window's selections plus the read-ahead
    depth (`min_slots`). `wired_budget`: the GPU's wired ceiling ("auto": asked of MLX on a
    Mac, None elsewhere); a plan over it is refused by `check_wired`.
    """
    budget, budget_reason = budget_bytes(config, model_files=model_files, available=available, total=total,
                                         ple_bytes=ple_bytes)
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
