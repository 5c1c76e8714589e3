"""Compiled twins of the reference's quantized products, for the numpy engines (docs/cpu.md).

    gemv(m, x)                  twin of strata.reference.quants.gemv (a routed expert's matrices)
    swiglu_expert(w, x, act)    twin of strata.reference.experts.swiglu_expert (its gemvs compiled)
    expert_stack(ws, x, act)    one token's experts in one call: [swiglu_expert(w, x, act) for w in ws]
    CompiledDense.linear        twin of DenseWeights.linear: x W^T on a dense matrix stored as
                                Q8_0 or a block type with a kernel (attention's projections, the head)

The routed experts' kernels compute Q8_0, Q4_0, Q2_0 and llama.cpp's Q4_K, Q5_K, Q6_K, Q3_K, Q2_K,
IQ4_NL, IQ4_XS, MXFP4 and Q5_1 as a GGUF stores them (COMPILED_TYPES); the dense matrices those
of them strata.formats.dense_weights keeps as stored (Q8_0 and the block types), or float.

The products run in native/quant_gemv.c (built at first use: native_build.py) straight on the
stored codes and float16 block scales, with x kept in float32: nothing is widened to a float32
copy of the matrix, which is where the numpy path spent its time (two thirds of a decode token
on a made Q8_0 model went to `dequantize`). Only the float32 summation order (and the fused
experts' `expf`) differs from the reference; tests/numpy_backend/test_numpy_quant_kernels.py holds each twin
to it within FAST (tests/budgets.py).

`CpuOps` bundles the products an engine computes with: `REFERENCE_OPS` (the float32 reference)
or `compiled_ops()` (these twins, where the library builds; else the reference with a one-line
note). A matrix of a type without a compiled kernel goes to the reference's product, per call,
and so does a product over more than `max_compiled_rows` rows (a long prompt's: BLAS's).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from strata.formats.dense_weights import DenseWeights, StoredTensor, StoredType
from strata.formats.expert_record import ExpertWeights
from strata.formats.quant_types import QuantType, is_whole_blocks
from strata.model_config import ExpertKind
from strata.numpy_backend import native_build
from strata.reference import experts as ref_experts
from strata.reference import quants as ref_quants
from strata.reference.experts import SWIGLU, ExpertAct
from strata.reference.quants import QuantMatrix

__all__ = ["COMPILED_TYPES", "KERNELS", "kernel", "run_kernel", "expert_stack", "stack_kernel", "run_stack_kernel",
           "CompiledDense", "CpuOps", "REFERENCE_OPS", "compiled_ops", "gemv", "swiglu_expert"]

# every type native/quant_gemv.c computes, and its symbol there: strata's two-plane Q8_0, Q4_0,
# Q2_0, and llama.cpp's block types kept as a GGUF stores them (whole blocks, scales inside)
_NAMES = {
    QuantType.Q8_0: "q8_0", QuantType.Q4_0: "q4_0", QuantType.Q2_0: "q2_0", QuantType.Q4_K: "q4_k",
    QuantType.Q5_K: "q5_k", QuantType.Q6_K: "q6_k", QuantType.Q3_K: "q3_k", QuantType.Q2_K: "q2_k",
    QuantType.IQ4_NL: "iq4_nl", QuantType.IQ4_XS: "iq4_xs", QuantType.GGML_MXFP4: "mxfp4", QuantType.Q5_1: "q5_1"}
KERNELS: dict[QuantType, str] = {q: f"strata_{name}_gemv" for q, name in _NAMES.items()}
assert set(_NAMES.values()) == set(native_build.GEMV_TYPES)
# the types the engines compute on their kernel (every one in KERNELS). The runtime's bit-for-bit
# tests compare a streaming engine with the all-resident engine, and with the analysis tools, on
# the same products (strata.testing.engines.open_numpy_reference, strata.tools.options.tool_ops).
COMPILED_TYPES = frozenset(KERNELS)
PROJECTIONS = ("gate", "up", "down")  # an expert's matrices, in the fused kernel's order
# Rows of x above which the reference's product (widen the matrix once, one float32 BLAS matrix
# product) takes over. The kernel serves 4 rows per pass over the matrix (TILE in the C source);
# measured on a 768 x 2048 Q8_0 matrix, one BLAS thread, 2-core machine under load: the kernel
# 99x faster at 1 row, 10x at 16, 1.2-1.5x at 32-64 (docs/cpu.md), so prompts' longer products
# go to BLAS, where a quiet many-core machine gains most.
MAX_COMPILED_ROWS = 16
# The same for llama.cpp's block types, whose widening (the reference's numpy dequantization) costs
# 2-10x Q8_0's: on 768 x 2048 matrices, one thread, the kernel against the reference took 5.1-6.4
# ms against 15-36 ms at 64 rows (Q4_K, Q6_K, IQ4_NL, Q3_K) and lost only Q4_K's at 128
# (benchmarks/cpu_kernels.py, docs/cpu.md).
MAX_COMPILED_ROWS_BLOCKS = 64


def max_compiled_rows(qtype: QuantType) -> int:
    """Rows of x up to which a product of `qtype` runs on its kernel (above: the reference's)."""
    return MAX_COMPILED_ROWS_BLOCKS if is_whole_blocks(qtype) else MAX_COMPILED_ROWS


def kernel(qtype: QuantType):
    """The compiled GEMV of `qtype` (a ctypes function; see `run_kernel` for its arguments), or None."""
    lib = native_build.library()
    name = KERNELS.get(qtype)
    return None if lib is None or name is None else getattr(lib, name)


def _kernel(qtype: QuantType):
    return kernel(qtype) if qtype in COMPILED_TYPES else None


# Weights below which a product runs on one thread: handing rows to the workers costs a few
# microseconds while they spin (native/quant_gemv.c's workers), far more once they sleep, and a
# 1M-weight Q8_0 product takes ~0.1-0.2 ms on one AVX2 core.
PARALLEL_MIN_WEIGHTS = 1 << 20


def _address_of(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def run_kernel(fn, codes: np.ndarray, scales: np.ndarray, n_rows: int, n_cols: int, x: np.ndarray, *,
               threads: int = 1) -> np.ndarray:
    """y = W x on the stored planes (C-contiguous codes [R, *] and float16 scales [R, C/32]).
    threads > 1: a product of at least PARALLEL_MIN_WEIGHTS is split into that many row ranges in
    one call (strata_gemv_threads: this thread computes one, the library's workers the rest); each
    row's arithmetic is the same whoever computes it.
    x [.., C] -> [.., R] float32"""
    flat = np.ascontiguousarray(x, np.float32).reshape(-1, n_cols)  # [T, C]
    y = np.empty((flat.shape[0], n_rows), np.float32)  # [T, R]
    if not (codes.flags.c_contiguous and scales.flags.c_contiguous):
        codes, scales = np.ascontiguousarray(codes), np.ascontiguousarray(scales)
    args = (codes.ctypes.data, scales.ctypes.data, n_rows, n_cols, flat.ctypes.data, flat.shape[0], y.ctypes.data)
    parts = min(threads, n_rows) if n_rows * n_cols >= PARALLEL_MIN_WEIGHTS else 1
    if parts <= 1:
        fn(*args, 0, n_rows)
    else:  # the split inside one call, on the library's workers
        native_build.library().strata_gemv_threads(_address_of(fn), *args, parts)
    return y.reshape(*np.shape(x)[:-1], n_rows)


def _rows(x: np.ndarray) -> int:
    return 1 if np.ndim(x) == 1 else int(np.prod(np.shape(x)[:-1]))


def gemv(m: QuantMatrix, x: np.ndarray, *, threads: int = 1) -> np.ndarray:
    """Twin of reference `gemv`: y = W x on the stored weights, in float32 (`threads`: run_kernel's).

    Shapes:
        x: [n_cols] or [T, n_cols] -> y: [n_rows] or [T, n_rows]
    """
    fn = _kernel(m.qtype)
    if fn is None or _rows(x) > max_compiled_rows(m.qtype):
        return ref_quants.gemv(m, x)
    if np.shape(x)[-1] != m.n_cols:
        raise ValueError(f"gemv: x has {np.shape(x)[-1]} features, the matrix wants {m.n_cols}")
    return run_kernel(fn, m.codes, m.scales, m.n_rows, m.n_cols, x, threads=threads)


def _address(a: np.ndarray) -> int:
    if not a.flags.c_contiguous:
        raise ValueError("expert_stack: the experts' planes must be C-contiguous")
    return a.__array_interface__["data"][0]


def expert_stack(ws: Sequence[ExpertWeights], x: np.ndarray, act: ExpertAct = SWIGLU, *,
                 threads: int = 1) -> np.ndarray:
    """One token's experts: row i is swiglu_expert(ws[i], x, act), the whole stack in one call of
    the fused kernel (a SwiGLU without biases whose gate, up and down are each of one compiled type
    over the experts, the three types free to differ; else expert by expert). threads > 1: the
    experts are split over that many threads.

    Shapes:
        ws: k experts; x: [D] -> [k, D] float32
    """
    types = [{getattr(w, p).qtype for w in ws} for p in PROJECTIONS]  # each projection's types over the experts
    lib = native_build.library()
    if (act.kind is not ExpertKind.SWIGLU or any(w.biases is not None for w in ws) or lib is None
            or any(len(t) != 1 or not t <= COMPILED_TYPES for t in types)):
        return np.stack([swiglu_expert(w, x, act, threads=threads) for w in ws]) if ws else \
            np.zeros((0, np.shape(x)[-1]), np.float32)
    return run_stack_kernel(stack_kernel(lib, *(next(iter(t)) for t in types)), ws, x, threads=threads)


@functools.cache  # per library and types: a decode token asks once per layer
def stack_kernel(lib, gate: QuantType, up: QuantType, down: QuantType) -> Callable[..., None]:
    """The fused experts' kernel of `lib` (a build of native/quant_gemv.c) for experts whose
    gate, up and down are of these compiled types: `strata_swiglu_threads` with the three GEMVs
    bound (its last argument the thread count)."""
    gemvs = [_address_of(getattr(lib, KERNELS[q])) for q in (gate, up, down)]
    return functools.partial(lib.strata_swiglu_threads, *gemvs)


def run_stack_kernel(fn, ws: Sequence[ExpertWeights], x: np.ndarray, *, threads: int = 1) -> np.ndarray:
    """The fused experts' kernel `fn` (a `stack_kernel`) on ws, split over `threads` by expert in
    one call (this thread takes the first group, the library's workers the others).
    ws: k experts of fn's types, no biases; x [D] -> [k, D] float32"""
    x = np.ascontiguousarray(x, np.float32)
    hidden, ffn = ws[0].down.n_rows, ws[0].gate.n_rows
    out = np.empty((len(ws), hidden), np.float32)  # [k, D]
    parts = max(1, min(threads, len(ws)))
    planes = [(ctypes.c_void_p * len(ws))(*[_address(getattr(getattr(w, p), part)) for w in ws])
              for p in PROJECTIONS for part in ("codes", "scales")]
    scratch = np.empty(parts * 2 * ffn, np.float32)  # one [gate | up] per thread
    fn(len(ws), *planes, hidden, ffn, x.ctypes.data, out.ctypes.data, scratch.ctypes.data, parts)
    return out


def swiglu_expert(w: ExpertWeights, x: np.ndarray, act: ExpertAct = SWIGLU, *, threads: int = 1) -> np.ndarray:
    """Twin of reference `swiglu_expert`: the same steps, its three products by `gemv` above.

    Shapes:
        x: [D] or [T, D] -> [D] or [T, D]
    """
    matvec = gemv if threads == 1 else functools.partial(gemv, threads=threads)
    return ref_experts.swiglu_expert(w, x, act, matvec=matvec)


class CompiledDense(DenseWeights):
    """The same held weights (no copy), with `linear` on the stored bytes where a matrix is held
    as Q8_0 or as one of llama.cpp's block types with a kernel (a GGUF's Q6_K head and
    attention); every other use (widening, rows, other types) is DenseWeights' own."""

    def __init__(self, dense: DenseWeights, *, threads: int = 1) -> None:
        super().__init__(dense.held)
        self.threads = threads

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        """Twin of DenseWeights.linear. x [T, C] -> [T, R]"""
        t = self.stored(name)
        if not isinstance(t, StoredTensor) or t.qtype in (StoredType.F16, StoredType.BF16) or t.ndim != 2 \
                or _rows(x) > max_compiled_rows(t.qtype.quant_type):
            return super().linear(name, x)
        fn = _kernel(t.qtype.quant_type)
        if fn is None:
            return super().linear(name, x)
        rows, cols = t.rows_cols
        scales = t.scales if t.scales is not None else _NO_SCALES  # block types: scales inside the blocks
        return run_kernel(fn, t.codes, scales, rows, cols, x, threads=self.threads)


_NO_SCALES = np.zeros((0,), np.float16)  # a block type's (unread) scales plane


def _as_is(dense: DenseWeights) -> DenseWeights:
    return dense


@dataclass(frozen=True)
class CpuOps:
    """The products a numpy engine computes with (one choice per engine, made at open)."""

    expert: Callable[..., np.ndarray]  # swiglu_expert(w, x, act)
    dense: Callable[[DenseWeights], DenseWeights]  # the view of the dense weights whose `linear` is used
    stack: Callable[..., np.ndarray] | None = None  # expert_stack(ws, x, act): one token's experts at once
    compiled: bool = False
    threads: int = 1  # the compiled products' threads
    note: str = ""  # why the compiled products are not in use ("" where they are, or not asked for)


REFERENCE_OPS = CpuOps(ref_experts.swiglu_expert, _as_is)


def compiled_ops(threads: int = 1) -> CpuOps:
    """The compiled twins (on `threads` threads) where the library builds on this machine; else
    the reference's float32 products and a one-line note saying why."""
    if native_build.library() is None:
        why = native_build.reason()
        return dataclasses.replace(REFERENCE_OPS, note=f"compiled CPU kernels unavailable, numpy's float32 path instead: {why}")
    return CpuOps(functools.partial(swiglu_expert, threads=threads), functools.partial(CompiledDense, threads=threads),
                  functools.partial(expert_stack, threads=threads), compiled=True, threads=threads)
