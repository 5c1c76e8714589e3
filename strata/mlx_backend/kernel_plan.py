"""The kernel plan: which forms the MLX backend's kernels take, one frozen value.

Why: each choice below is either what a backend can do (Metal has no chained launches) or how a
caller runs the decode loop; the losing forms of the kernels' experiments are deleted, not kept
behind switches (their numbers are in docs/perf.md's history, docs/log/). A backend's plan is
`plan_for(path, dialect)`; `MlxEngine(plan=)` takes one and benchmarks take `PRESETS` by name.
Kernel wrappers read `current()`: the plan given by `using_plan` (a context, like
launch.using_path), never more than the backend can do.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
from dataclasses import dataclass, field, replace
from typing import Iterator

from strata.mlx_backend.kernels.paths import KernelPath, current_path, gpu_dialect
from strata.mlx_backend.kernels.preludes import Dialect

__all__ = ["GroupedGemm", "KernelPlan", "plan_for", "backend_plan", "current", "using_plan", "PRESETS", "preset"]


class GroupedGemm(enum.Enum):
    """How a prompt's sorted (token, expert) pairs meet their experts' weights (grouped.py)."""

    GATHER = "gather"  # mx.gather_mm(sorted_indices=True): MLX's grouped GEMM, no padding
    PADDED = "padded"  # rows scattered into [E, cap, D] (cap: the largest group), one batched matmul
    TILED = "tiled"  # rows in tiles of TILE_ROWS of one expert each, mx.gather_mm by tile: no host sync
    Q2_MMA = "q2mma"  # PADDED's rows against the Q2_0 records themselves (kernels/q2_mma.py): no float16 copy
    Q2_TILES = "q2tiles"  # tiles of sorted rows against the records (grouped_tiles.py): no padding, no host sync


@dataclass(frozen=True)
class KernelPlan:
    """What the kernels do on one backend. The defaults are the measured winners (docs/perf.md).

    chained_launches: dependent launches as one (kernels/phases.py): CUDA and the emulator; Metal
        declares threadgroup memory at kernel scope and does not promise the forward progress a
        chained block's wait needs.
    spread_scores: the split attention sums a step's scores at once (kernels/attend_split.py):
        not on Metal, whose simd_sum does not follow warp_sum's xor order (the bits would differ).
    graph_views: large kernel inputs given as views of their first elements (kernels/launch.py
        makes them on MLX's CUDA build only, where a whole array counts toward its graph's commit
        size; elsewhere there is nothing to gain).
    compiled_decode: the decode step compiled (compiled.py) where the kernel path allows.
    pipelined: greedy decoding chooses the next token on the device (device_pipeline.py).
    eval_every: layers per asynchronous evaluation of an uncompiled forward (0: one at the end;
        every layer measured 9.90 ms a token against 9.44 for one, H200).
    prompt_paths: the kernel paths on which the engines take the prompt path (prompt.py; the GPU:
        tests add the others to run it on the CPU).
    grouped_gemm: the prompt's grouped GEMM form (None: by the device, grouped.default_gemm).
    grouped_min_pairs: pairs per distinct expert from which a layer's experts take the grouped
        GEMM (None: grouped.MIN_PAIRS by form; 0: always).
    bucket_positions: a first prompt chunk's attention padded to a bucket of positions
        (prompt_attention.py; None: on MLX's CUDA build, where each new length built a cuDNN graph).
    """

    chained_launches: bool = True
    spread_scores: bool = True
    graph_views: bool = True
    compiled_decode: bool = True
    pipelined: bool = True
    eval_every: int = 0
    prompt_paths: frozenset[KernelPath] = field(default_factory=lambda: frozenset({KernelPath.GPU}))
    grouped_gemm: GroupedGemm | None = None
    grouped_min_pairs: int | None = None
    bucket_positions: bool | None = None

    def __post_init__(self) -> None:
        if self.eval_every < 0:
            raise ValueError(f"KernelPlan: eval_every {self.eval_every} < 0 (0: one evaluation at the end)")

    def within(self, able: KernelPlan) -> KernelPlan:
        """This plan with every capability `able` lacks turned off."""
        return replace(self, chained_launches=self.chained_launches and able.chained_launches,
                       spread_scores=self.spread_scores and able.spread_scores,
                       graph_views=self.graph_views and able.graph_views)


@functools.cache
def plan_for(path: KernelPath, dialect: Dialect | None) -> KernelPlan:
    """The default plan of a kernel path (and the GPU's dialect). Cached, as `current` is: kernel
    wrappers ask on every launch, and the streaming host turn has ~50 us a layer for all of them."""
    metal = path is KernelPath.GPU and dialect is Dialect.METAL
    cuda = path is KernelPath.GPU and dialect is Dialect.CUDA
    return KernelPlan(chained_launches=path is KernelPath.EMULATED or cuda, spread_scores=not metal)


def backend_plan() -> KernelPlan:
    """The default plan of the kernel path in force."""
    return plan_for(current_path(), gpu_dialect())


_given: contextvars.ContextVar[KernelPlan | None] = contextvars.ContextVar("strata_kernel_plan", default=None)


def current() -> KernelPlan:
    """The plan in force: `using_plan`'s within the backend's capabilities, else the backend's."""
    able = backend_plan()
    given = _given.get()
    return able if given is None else _within(given, able)


@functools.lru_cache(maxsize=64)
def _within(given: KernelPlan, able: KernelPlan) -> KernelPlan:
    return given.within(able)


@contextlib.contextmanager
def using_plan(plan: KernelPlan | None) -> Iterator[None]:
    """Kernel-backed functions follow `plan` inside the block (None: the plan in force stays)."""
    if plan is None:
        yield
        return
    token = _given.set(plan)
    try:
        yield
    finally:
        _given.reset(token)


# The forms a benchmark compares by name (benchmarks/decode_context.py, peers.py ...)
PRESETS: dict[str, KernelPlan] = {
    "default": KernelPlan(),
    "unchained": KernelPlan(chained_launches=False),  # Metal's launches on CUDA: one per kernel
    "no_views": KernelPlan(graph_views=False),  # whole arrays given to MLX (a graph commit per expert kernel)
    "uncompiled": KernelPlan(compiled_decode=False),
    "host_loop": KernelPlan(pipelined=False),  # each greedy token's logits read on the host
}


def preset(name: str) -> KernelPlan:
    """PRESETS[name]; an unknown name is a ValueError naming the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown kernel plan {name!r} (known: {', '.join(PRESETS)})")
    return PRESETS[name]
