"""Build each kernel once and launch it on the path in force (paths.py: a GPU, the emulator, or
none): on a GPU a body is built once (mlx-lm's `gated_delta.py` pattern) and specialised by
template arguments; KernelPath and the path helpers are re-exported here for the callers.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np

from strata.mlx_backend import kernel_plan
from strata.mlx_backend.kernels import emulate, included_source
from strata.mlx_backend.kernels.paths import KernelPath, current_path, gpu_dialect, using_path  # noqa: F401 - the callers import them from here
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.kernels.source import MIN_INPUT_SIZE, KernelSource, mlx_source


LAUNCHES: collections.Counter = collections.Counter()  # custom-kernel launches by kernel name (benchmarks)

_recording: contextvars.ContextVar[list | None] = contextvars.ContextVar("strata_kernel_recording", default=None)


class _EveryLaunch(list):
    """A recording that keeps every launch, not each specialisation once."""


@contextlib.contextmanager
def recording(every: bool = False) -> Iterator[list]:
    """Collect (source, input dtype names, output dtype names, template) of every specialisation
    launched in the block, once each (the compile checks build each one that actually ran for
    Metal and CUDA); every: once per launch."""
    seen: list = _EveryLaunch() if every else []
    token = _recording.set(seen)
    try:
        yield seen
    finally:
        _recording.reset(token)


_signatures: dict[tuple, tuple[str, ...]] = {}  # (name, template) -> dtypes it was launched with


# (kernel name, its inputs, its outputs) -> the MLX kernel object, built once (a dict lookup per
# launch). A source with some outputs folded, or with inputs packed into one buffer
# (folded_outputs.py), keeps its name: its inputs and outputs tell the build apart, its template
# the offsets.
_kernels: dict[tuple[str, tuple[str, ...], tuple[str, ...]], object] = {}


def _kernel_key(src: KernelSource) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    return src.name, src.inputs, src.outputs


def _build(src: KernelSource):
    dialect = gpu_dialect()
    header, body = mlx_source(src, dialect)
    if dialect is Dialect.CUDA:
        header, body = included_source.included(header, body, src.inputs)
    make = mx.fast.metal_kernel if dialect is Dialect.METAL else mx.fast.cuda_kernel
    kernel = make(name=src.name, input_names=list(src.inputs), output_names=list(src.outputs),
                  source=body, header=header)
    if _kernels.setdefault(_kernel_key(src), kernel) is not kernel:
        raise ValueError(f"two kernel bodies are named {src.name}")
    return kernel


HOST_INPUTS: collections.Counter = collections.Counter()  # host (numpy) inputs by kernel name (tests, benchmarks)


def _padded(a, name: str) -> mx.array:
    """An input of at least MIN_INPUT_SIZE elements. Host (numpy) inputs are padded on the host,
    which costs no launch (but see `device_const`); a small MLX array costs one concatenate
    (avoid in hot paths)."""
    if isinstance(a, np.ndarray):
        HOST_INPUTS[name] += 1
        a = np.ascontiguousarray(a)
        if a.size < MIN_INPUT_SIZE:
            a = np.concatenate([a.reshape(-1), np.zeros(MIN_INPUT_SIZE - a.size, a.dtype)])
        return mx.array(a)
    if a.size >= MIN_INPUT_SIZE:
        return a
    flat = a.reshape(-1)
    return mx.concatenate([flat, mx.zeros((MIN_INPUT_SIZE - a.size,), dtype=a.dtype)])


def as_f32(a):
    """a as float32 without an op when it already is (host arrays are converted on the host)."""
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a, dtype=np.float32)
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


# ---------------------------------------------------------------- per-call scalars stay on the device
#
# On MLX's CUDA build an array made from host memory is CUDA managed memory the host has just
# written: the first kernel that reads it stalls on a GPU page fault while the page migrates. On the
# H200 (MLX 0.32.4) a custom kernel fed two fresh host arrays per call cost 50 us per launch against
# 6.7 us for an MLX op, and ncu timed the fused expert kernel (14 MB) at 230-257 us of GPU time with
# fresh host slot arrays. So the per-call scalars of the decode path never come from the host:
# constants are made once and kept in device memory (`device_const`, `absent`, `float_params`), and
# runtime indices (a position, a slot base, a token id) are views into a device arange
# (`index_param`, `index_view`): no host write, no launch.
#
# Each constant is evaluated when it is made. One made lazily inside `mx.compile`'s trace (the
# compiled decode step's first call makes most of its own) is not a constant to the trace but a
# node of it, recomputed on every call: an MLX add (and its broadcast) per `device_const`, the
# 65536-entry arange behind `index_view`, a slice per layer. An array evaluated when it is made
# is a leaf wherever it is used (evaluating one inside a trace is allowed: it is not a tracer):
# made lazily, a compiled step replayed 100 other nodes a token, not 41 (H200, seed shape).

_CONSTS: dict[tuple, mx.array] = {}
_CONSTS_MAX = 1024  # distinct constants kept (eps values, absent-input zeros: a handful per model)
_index_table: list[mx.array] = []
INDEX_TABLE_MIN = 1 << 16


def device_const(values) -> mx.array:
    """A small constant kernel input (padded to MIN_INPUT_SIZE), made once per (dtype, value) and
    kept in device memory: the host copy is read once, by the op that makes the device copy."""
    a = np.ascontiguousarray(values).reshape(-1)
    if a.size < MIN_INPUT_SIZE:
        a = np.concatenate([a, np.zeros(MIN_INPUT_SIZE - a.size, a.dtype)])
    key = (a.dtype.str, a.tobytes())
    hit = _CONSTS.get(key)
    if hit is None:
        if len(_CONSTS) >= _CONSTS_MAX:
            _CONSTS.pop(next(iter(_CONSTS)))
        hit = mx.array(a) + 0  # an op's output: device memory on MLX CUDA (the host array is not)
        mx.eval(hit)
        _CONSTS[key] = hit
    return hit


_by_key: dict[tuple, mx.array] = {}  # the two helpers below, keyed by their arguments (a lookup per launch)


def absent(dtype) -> mx.array:
    """The stand-in for an absent optional input (zeros of `dtype`; the body does not read it)."""
    key = ("absent", dtype)
    hit = _by_key.get(key)
    if hit is None:
        hit = _by_key[key] = device_const(np.zeros(MIN_INPUT_SIZE, np.dtype(dtype)))
    return hit


def float_params(*values: float) -> mx.array:
    """Runtime float constants for a kernel (an eps): device-resident, made once per value."""
    key = values
    hit = _by_key.get(key)
    if hit is None:
        if len(_by_key) >= _CONSTS_MAX:
            _by_key.clear()
        hit = _by_key[key] = device_const(np.array(values, dtype=np.float32))
    return hit


def index_view(i: int, n: int = 1) -> mx.array:
    """int32 [n] holding i, i+1, ..., i+n-1: a view into a device arange (no host write, no launch)."""
    if i < 0:
        raise ValueError(f"index_view: negative index {i}")
    table = _index_table
    tab = table[0] if table else None
    if tab is None or tab.size < i + n:
        size = max(INDEX_TABLE_MIN, i + n, 2 * (tab.size if tab is not None else 0))
        tab = mx.arange(size, dtype=mx.int32)
        mx.eval(tab)
        table[:] = [tab]
    return tab[i:i + n]


def index_param(i: int) -> mx.array:
    """A runtime int scalar for a kernel (a position, a slot base): element 0 of an int32
    [MIN_INPUT_SIZE] view into the device arange."""
    return index_view(i, MIN_INPUT_SIZE)


_index_consts: dict[int, mx.array] = {}


def index_const(i: int) -> mx.array:
    """`index_param(i)` for an i that stays the same from call to call (a layer's slot base),
    evaluated once and kept: a leaf of any graph, where `index_param`'s view is a slice node a
    compiled step replays every call. Not for runtime values: each new one is an evaluation."""
    hit = _index_consts.get(i)
    if hit is None:
        if len(_index_consts) >= _CONSTS_MAX:
            _index_consts.pop(next(iter(_index_consts)))
        hit = index_param(i)
        mx.eval(hit)
        _index_consts[i] = hit
    return hit


# MLX's CUDA encoder (mlx/backend/cuda/device.cpp, 0.32) commits its CUDA graph (update or
# instantiate, then launch) after any node once the sizes of the arrays its nodes were given add
# past max_mb_per_graph (1000 MB on sm_90): `set_input_array` counts a whole array, not what the
# kernel reads. The expert arena (17 GB at the seed shape) given to every layer's expert kernel
# therefore ended the graph after it: 48 commits a decoded token instead of ~3 (100 nodes a
# graph). A kernel gets only a pointer (no body reads an input's shape), so a large input goes in
# as a view of its first elements: the same buffer, the same dependency (MLX tracks buffers by
# address), MIN_INPUT_SIZE elements counted. CUDA only (the emulator copies what it is given;
# Metal's encoder is not measured): the kernel plan's graph_views.
GRAPH_VIEW_ABOVE = 1 << 20  # bytes: smaller inputs count for nothing that matters


def _views_here() -> bool:
    """Whether large inputs go in as views: the plan's graph_views, on MLX's CUDA build."""
    return gpu_dialect() is Dialect.CUDA and kernel_plan.current().graph_views


def _graph_view(a: mx.array) -> mx.array:
    """a, or (large) a view of its first elements: the same data pointer. A row-contiguous array
    flattens without a copy; any other is copied whole by the reshape, and the kernel reads the
    copy, so the view is never wrong, only slower. Past int32 elements (MLX's dimension type:
    only the expert arena, [slots, slot_bytes], row-contiguous by construction) it cannot be
    flattened: the view is its first row. Under `using_constant_views` a constant's view made
    (and evaluated) before the trace is given instead: the same pointer, no node in the graph."""
    if a.nbytes <= GRAPH_VIEW_ABOVE:
        return a
    views = _constant_views.get()
    if views is not None:
        hit = views.get(id(a))
        if hit is not None and hit[0] is a:
            VIEW_COUNTS["constant"] += 1
            return hit[1]
    VIEW_COUNTS["traced"] += 1
    return _first_elements(a)


def _first_elements(a: mx.array) -> mx.array:
    if a.size < MAX_FLAT:
        return a.reshape(-1)[:MIN_INPUT_SIZE]
    return a[(slice(0, 1),) * (a.ndim - 1)]


MAX_FLAT = 2**31 - 1

# A compiled step's graph replays every node of its trace on every call, the views of its
# constants included: on the H200 (MLX 0.32.4) a node costs the host ~1 us in the compiled call and
# more in the evaluation, and the seed shape's decoded token gave ~7 large constants a layer (the
# dense weights, the arena, the KV buffers) a reshape and a slice each. Made and evaluated once
# before the trace, such a view is a leaf of the graph (an evaluated array holding the same
# buffer), so the replay has no node for it. Keyed by id with the array kept beside its view, so
# an id reused by another array never hits.
_constant_views: contextvars.ContextVar[dict | None] = contextvars.ContextVar("strata_constant_views", default=None)
VIEW_COUNTS: collections.Counter = collections.Counter()  # views given: "constant" (made before), "traced"


def constant_views(arrays) -> dict[int, tuple[mx.array, mx.array]]:
    """The evaluated first-element views of those of `arrays` past GRAPH_VIEW_ABOVE bytes (arrays
    already evaluated: weights, the arena, KV buffers), for `using_constant_views`. Empty off
    MLX's CUDA build (where `launch` makes no views)."""
    if not _views_here():
        return {}
    out: dict[int, tuple[mx.array, mx.array]] = {}
    for a in arrays:
        if a.nbytes > GRAPH_VIEW_ABOVE and id(a) not in out:
            out[id(a)] = (a, _first_elements(a))
    mx.eval([v for _, v in out.values()])
    return out


@contextlib.contextmanager
def using_constant_views(views: dict | None) -> Iterator[None]:
    """Within: `launch` gives a kernel the view made before for any input in `views`."""
    token = _constant_views.set(views)
    try:
        yield
    finally:
        _constant_views.reset(token)


def launch(src: KernelSource, inputs: Sequence, output_shapes: Sequence[tuple[int, ...]],
           output_dtypes: Sequence, *, blocks: tuple[int, int, int], threads: int,
           template: Sequence[tuple[str, int]]) -> list[mx.array]:
    """Launch `src` over `blocks` (x, y, z) blocks of `threads` threads on the current path.

    `template` holds the compile-time ints. Inputs are mx.arrays or host numpy arrays; those
    smaller than MIN_INPUT_SIZE are padded (the bodies index them by their logical size).
    Must not be called on the OPS path.
    """
    path = current_path()
    template = tuple(template)  # (name, Python int) pairs, as the callers build them
    grid = (blocks[0] * threads, blocks[1], blocks[2])
    inputs = [a if type(a) is mx.array and a.size >= MIN_INPUT_SIZE else _padded(a, src.name) for a in inputs]
    LAUNCHES[src.name] += 1
    sig = (src.name, template)
    dtypes = tuple([a.dtype for a in inputs] + list(output_dtypes))
    seen = _signatures.get(sig)
    if seen is None:
        _signatures[sig] = dtypes
    elif seen != dtypes:
        # one build per (name, template values): MLX 0.32 names the module by those and a hash of
        # the generated source (which spells the dtypes: custom_kernel.cpp), older MLX by the
        # first two only, where other dtypes would silently have run the first build
        raise TypeError(f"kernel {src.name} {dict(template)}: dtypes {dtypes}, built for {seen}; "
                        "add a template argument that tells them apart")
    rec = _recording.get()
    if rec is not None:
        key = (src, tuple(str(a.dtype).split(".")[-1] for a in inputs),
               tuple(str(d).split(".")[-1] for d in output_dtypes), template)
        if isinstance(rec, _EveryLaunch) or key not in rec:
            rec.append(key)
    tg = (threads, 1, 1)
    if path is KernelPath.GPU:
        if not src.metal and gpu_dialect() is Dialect.METAL:
            raise RuntimeError(f"kernel {src.name} runs on CUDA and the emulator only (its caller checks first)")
        kernel = _kernels.get(_kernel_key(src)) or _build(src)
        if _views_here():
            inputs = [_graph_view(a) for a in inputs]
        return kernel(inputs=inputs, template=list(template), grid=grid, threadgroup=tg,
                      output_shapes=list(output_shapes), output_dtypes=list(output_dtypes))
    if path is KernelPath.EMULATED:
        mx.eval(*inputs)
        # zero-copy: in-place writes reach MLX memory; a strided view (a DeltaNet conv state after
        # a prompt) is copied, as MLX's kernels copy it (ensure_row_contiguous)
        host = [np.ascontiguousarray(np.array(a, copy=False)) for a in inputs]
        outs = emulate.run(src, host, [tuple(s) for s in output_shapes],
                           [np.dtype(str(d).split(".")[-1]) for d in output_dtypes], grid, tg, template)
        return [mx.array(o) for o in outs]
    raise RuntimeError(f"kernel {src.name} launched on the OPS path: the caller must use its MLX-ops twin")


# Threads a block of the prompt's row kernels (pair_sort, prompt_topk, row_norm, qkv_rope: bodies
# written for any power of two from 32) on the emulated path: the emulator runs one OS thread per
# GPU thread and every barrier switches them all: at 256 threads a block the small 4-layer probe's
# emulated prompt took 68 s against 18 s with the ops they replace (tests; the GPU keeps its count).
EMULATED_THREADS = 64


def block_threads(gpu: int) -> int:
    """`gpu` threads a block on the GPU path, EMULATED_THREADS (at most `gpu`) on the emulated one."""
    return min(gpu, EMULATED_THREADS) if current_path() is KernelPath.EMULATED else gpu
