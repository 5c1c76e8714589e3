"""The MLX backend: the interfaces of strata.reference on MLX arrays, with custom kernels whose
bodies are shared by Metal, CUDA and a CPU emulator (docs/mlx_backend.md).

Modules (one concept each; the same names as strata/reference/ where they twin it):
    quants     Q2_0 / Q4_0 / Q8_0 in MLX's affine layout; dequantize, gemv
    routing    route / route_batch (MoCE), exact ranking on the device
    experts    SwiGLU experts: fused kernel, gather_qmm ops path, shared expert, combine
    attention  attention with a preallocated KV cache written in place
    mixers     the mixers' table by kind (weights, empty state, partials), the twin of reference/mixers.py
    residual   the residual stream's strategies (plain, hyper-connections), the twin of reference/residual.py
    model      MlxParams, the layer steps and forward (one loop over the residual's strategy)
    arena      MlxArena: the runtime's Arena over MLX memory (zero-copy slot writes)
    compute    MlxCompute: the runtime's LayerCompute
    engine     MlxEngine (all-resident), streaming_parts (arena + compute for the runtime's engine)
    kernel_plan  KernelPlan: the forms the kernels take on each backend, presets for benchmarks
    twins      the reference <-> MLX twin table the differential tests iterate
    jit_cache  where MLX's CUDA build keeps the kernels it compiles (MLX_PTX_CACHE_DIR's default)
    shape_buckets  the fixed shape set that keeps a new prompt length from compiling a kernel
    kernels/   the shared bodies, per-dialect preludes, build-once launch, the emulator
"""

import os as _os

# Full float32 matrix products. MLX runs float32 matmul-family ops (matmul, quantized matmul,
# attention) at reduced precision (TF32: a 10-bit mantissa) on GPUs with matrix units unless
# MLX_ENABLE_TF32=0 is set before the first such op (MLX's "Numerical Precision" page). The ops
# path promises float32 agreement with the reference (tests/mlx_agree.py FAST: 2e-5 relative),
# and TF32 rounding alone is ~2^-11 per operand: on the H200 the ops-path twins that multiply
# matrices failed with it. A value set by the user is kept.
_os.environ.setdefault("MLX_ENABLE_TF32", "0")

# MLX's CUDA build caches the kernels it JIT-compiles on disk, by default under the temp
# directory: point it at the user's cache directory (jit_cache.py) unless the user set it.
from strata.mlx_backend import jit_cache as _jit_cache  # noqa: E402

_jit_cache.set_default()
