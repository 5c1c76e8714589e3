"""The embedding kernel: rows of the float16 token-embedding table as float32 activations, one
launch (the ops path takes two: a gather and a conversion). A decode token's id is a view into
the device index table (`launch.index_param`), so the token never crosses from the host.

Shapes:
    table float16 [V, D], tokens int32 [>= T] -> float32 [T, D]
"""

from __future__ import annotations

import mlx.core as mx

from strata.mlx_backend.kernels.launch import launch
from strata.mlx_backend.kernels.source import KernelSource

THREADS = 256

BODY = r"""
  const uint32_t t = by;
  const uint32_t d = bx * NT + tid;
  if (d < (uint32_t)D) out[(uint64_t)t * D + d] = F32(table[(uint64_t)tokens[t] * D + d]);
"""

SOURCE = KernelSource("strata_embed", ("table", "tokens"), ("out",), BODY)


def embed_rows(table: mx.array, tokens, n_tokens: int) -> mx.array:
    """Kernel path. table float16 [V, D]; tokens int32 (mx view or host array), first n_tokens used
    -> float32 [n_tokens, D]

    A device `tokens` (a `launch.index_param(token)` view, or an input of a traced function) is
    read as it is: no range check here (the kernel reads row tokens[t] unchecked; callers check
    ids on the host, where they still are Python ints)."""
    if isinstance(tokens, mx.array) and (tokens.dtype != mx.int32 or tokens.size < n_tokens):
        raise ValueError(f"embed kernel: tokens must be int32 with at least {n_tokens} elements, "
                         f"got {tokens.dtype} [{tokens.size}]")
    d = table.shape[1]
    return launch(SOURCE, [table, tokens], [(n_tokens, d)], [mx.float32],
                  blocks=((d + THREADS - 1) // THREADS, n_tokens, 1), threads=THREADS,
                  template=(("D", d), ("NT", THREADS)))[0]
