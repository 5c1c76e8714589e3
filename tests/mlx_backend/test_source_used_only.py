"""The CUDA header a kernel gets holds only the prelude items its body reaches (source.used_only):
MLX's CUDA build hashes the whole source on every evaluation. What is kept compiles (every
recorded kernel: tests/mlx_backend/test_metal_compile.py); here, what is kept and dropped."""

from __future__ import annotations

from strata.mlx_backend.kernels import dense_gemv
from strata.mlx_backend.kernels.preludes import HEADER, Dialect
from strata.mlx_backend.kernels.source import compact, mlx_source, used_only

HEADER_TEXT = compact(r"""
#define SCALE 2.0f
#define UNUSED_MACRO 1
typedef float real_t;
struct pair { real_t a, b; };
struct lonely { int x; };
INLINE real_t twice(real_t x) {
  if (x > 0.0f) { return x * SCALE; }
  return x;
}
INLINE pair make(real_t a) { pair p; p.a = twice(a); p.b = a; return p; }
INLINE float unused(float x) { return x; }
static const int table[2] = {1, 2};
""")


def test_items_the_body_reaches_are_kept_in_order_with_what_they_reach():
    got = used_only(HEADER_TEXT, compact("  const pair p = make(1.0f);\n"))
    assert "make(" in got and "twice(" in got and "struct pair" in got and "typedef float real_t" in got
    assert "#define SCALE" in got  # reached through twice
    assert "UNUSED_MACRO" not in got and "unused(" not in got and "lonely" not in got
    assert got.index("typedef") < got.index("struct pair") < got.index("twice(") < got.index("make(")
    assert "static const int table" in got  # an item whose name is not recognised stays


def test_a_body_that_names_nothing_gets_only_the_unrecognised_items():
    assert used_only(HEADER_TEXT, compact("  int k = 0;\n")).splitlines() == [compact("static const int table[2] = {1, 2};").strip()]


def test_the_cuda_header_of_a_decode_kernel_is_a_fraction_of_the_prelude():
    header, body = mlx_source(dense_gemv.SOURCE, Dialect.CUDA)
    full = compact(HEADER[Dialect.CUDA])
    assert len(header) < len(full) / 3
    for name in ("h8_f8", "warp_sum", "sqrt_f", "half_t", "BARRIER", "UNROLL"):  # what the GEMV's body names
        assert name in header
    metal_header, _ = mlx_source(dense_gemv.SOURCE, Dialect.METAL)
    assert metal_header == compact(HEADER[Dialect.METAL])  # Metal and the emulator keep the whole prelude


