"""Per-dialect preludes: the only code that differs between Metal, CUDA and the emulator.

A kernel body (strata/mlx_backend/kernels/*.py) is written once against these names:

    ids        tid (thread in block), bx/by/bz (block in grid), lane (0..31), warp_id
    memory     SHARED (block-shared array), DEVICE (global-memory pointer qualifier),
               SHARED_PTR(T) (a pointer to T in block-shared memory: another view of a SHARED array),
               BARRIER() (block barrier, threadgroup memory)
    reductions warp_sum(float), warp_max(float): uniform across the 32 lanes
    fma_keep(a, b, c) a * b + c rounded once, subnormal operands and results kept (no flush to zero)
    warp_sync() a warp barrier (every lane of the warp calls it), used as a scheduling fence: ptxas
               issues every global load above it before any use below (without one it interleaves
               a GEMV's 16-byte loads with their FMAs, 3 in flight, to stay at 32 registers)
    types      half_t (IEEE binary16), uint2 / uint4 / float4 (vector loads), f4 / f8 (float
               arrays returned by value), uint32_t / int32_t / uint64_t
    math       F32(x) (to float), to_half(x) (float to half_t, to nearest even), exp_f, sqrt_f, log1p_f (log(1 + x), accurate near 0), NEG_BIG (a finite -infinity), UNROLL,
               bits_f32(u) (the float whose bits are the uint32_t u), f32_bits(f) (the reverse),
               opaque(u) (u, as a value the compiler may not re-derive from how it was
               computed), f16_bits(h) (a half_t's bits as uint32_t)
    loads      load_f4(p) (4 floats), load_h8(p) (8 halves as floats); 16-byte aligned;
               h8_f8(u) (the 8 halves of a uint4 loaded raw, as floats: a load whose use is later)
    matrix     mma_16816(c, a, lda, b, ldb, lane): one warp's C[16x8] += A[16x16] B[16x8] in float32,
               A row-major and B as [n][k], float16 bits (uint16_t) in shared memory; c holds the
               lane's four elements of C as CUDA's m16n8k16 places them (rows g, g + 8 and
               columns 2t, 2t + 1 of g = lane / 4, t = lane % 4). CUDA: the tensor-core `mma`;
               Metal and the emulator: those four dot products in float32 (Metal: not the matrix
               units; compile-checked, not run).
               mma_16816_frag(c, mma_a_frag(a, lda, lane), b, ldb, lane): the same product with
               A's registers loaded once (`afrag`) for the many B tiles one A tile meets
               mma_16816_ab(c, mma_a_ldm(a, lda, lane), mma_b2_ldm(b, ldb, lane), j, lane): the same
               product, A's fragment and two n-tiles' B fragments (rows b.. and b + 8 ldb..,
               `bfrag2`, j = 0 / 1 picks one) each loaded by one `ldmatrix.x4` on CUDA (four 8x8
               matrices, one instruction instead of four or two 32-bit shared loads); elsewhere
               the pointers, the same four dot products
               mma_16816_ar(c, fa, b0, b1, xw, slot, lane): B's fragment from the lane's registers b0, b1
               (as m16n8k16 places them: column g, rows 2t.. and 2t + 8..), words `slot`, `slot + 1`
               of the lane's `u16w` that `breg_publish(xw, words, lane)` published. The emulator and
               Metal: xw is the warp's [32, 16] words of a SHARED array of BREG_XCHG (1) NT 16 words,
               which their dot products read (a lane's C needs other lanes' B); CUDA: BREG_XCHG 0,
               publishing does nothing and b0, b1 go to `mma`
    shuffle    shfl_xor_f(x, m): lane ^ m's x; shfl_xor_fx16(v, m): lane ^ m's 16 floats (`fx16`, one
               exchange on the emulator instead of 16); shfl_f(x, src): lane src's x; every lane of
               the warp calls them
    sums       warp_sums_spread(v, p2, lane): warp_sum of each of p2 values (`fx32`, p2 a power of
               two <= 32) at once, lane l holding value l >> (5 - log2 p2)'s, each warp_sum's bits
               (CUDA, Metal: warp_sum's xor levels, halving the values a lane holds; the emulator:
               its warp_sum's lane order)
    terms      split_h2(a, b): (hi, lo) float16 terms of a and b, each pair one word (a in the low
               half): lowp.py's hi = f16(x), lo = f16(x - hi)
    bytes      byte_perm(x, y, s): CUDA's __byte_perm (byte i of the result is byte s's nibble i of
               the 8 bytes y:x; one PRMT on CUDA, a loop elsewhere)

Each dialect has a *header* prelude (types, helpers; MLX's `header=`) and a *body* prelude
(thread ids as locals; prepended to MLX's `source=`, because MLX adds a Metal attribute to the
signature only when its name appears in the body, and CUDA has no attributes at all).

Dialects:
- METAL: MLX `mx.fast.metal_kernel` (Apple GPUs). simdgroups are 32 wide on Apple GPUs.
- CUDA: MLX `mx.fast.cuda_kernel` (NVIDIA; NVRTC). There is no `uint` in CUDA: bodies use
  uint32_t. warp_sum broadcasts lane 0's sum so every lane holds the same bits.
- EMU: C++20 on the CPU (strata.mlx_backend.kernels.emulate): one fiber per GPU thread,
  switched at barriers, blocks one after another, warp reductions through a per-warp buffer. SHARED is `static` (one copy, shared by the block's threads; blocks never overlap).
  It runs the shared bodies in CI, where MLX's CPU build cannot run custom kernels.
"""

from __future__ import annotations

import enum


class Dialect(enum.Enum):
    METAL = "metal"
    CUDA = "cuda"
    EMU = "emu"


# Helpers whose portable form Metal and the emulator share (CUDA has its own: __half22float2, one
# PRMT): h8_f8 from h16_f32, byte_perm as a loop over the 4 result bytes.
_PORTABLE_HELPERS = r"""
INLINE f8 h8_f8(uint4 u) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  f8 r;
  for (int i = 0; i < 4; ++i) { r.v[2 * i] = h16_f32((uint16_t)(w[i] & 0xFFFFu)); r.v[2 * i + 1] = h16_f32((uint16_t)(w[i] >> 16)); }
  return r;
}
INLINE uint2 split_h2(float a, float b) {
  const half_t ha = to_half(a), hb = to_half(b);
  uint2 r;
  r.x = f16_bits(ha) | (f16_bits(hb) << 16);
  r.y = f16_bits(to_half(a - F32(ha))) | (f16_bits(to_half(b - F32(hb))) << 16);
  return r;
}
INLINE uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {  // CUDA's __byte_perm: byte i <- byte s[4i..] of {y:x}
  uint32_t r = 0u;
  for (uint32_t i = 0; i < 4u; ++i) {
    const uint32_t k = (s >> (4u * i)) & 7u;
    r |= ((k < 4u ? x >> (8u * k) : y >> (8u * (k - 4u))) & 0xffu) << (8u * i);
  }
  return r;
}
"""

# warp_sums_spread on CUDA and Metal (the emulator's keeps its own warp_sum order)
_SPREAD_XOR = r"""
struct fx32 { float v[32]; };
// warp_sum's xor levels 16 .. 1 over p2 values at once: a lane holding more than one keeps the half
// its lane bit picks and adds its partner's copy of that half (own + partner, as warp_sum adds), so
// each value's sum has warp_sum's bits, for p2 - 1 + 5 - log2 p2 shuffles in all instead of 6 p2
INLINE float warp_sums_spread(fx32 v, int p2, uint32_t lane) {
  int cnt = p2;
  UNROLL for (int o = 16; o > 0; o >>= 1) {
    if (cnt >= 2) {
      const bool hi = (lane & (uint32_t)o) != 0u;
      const int half = cnt / 2;
      UNROLL for (int i = 0; i < 16; ++i) {
        if (i < half) {
          const float send = hi ? v.v[i] : v.v[i + half];
          const float keep = hi ? v.v[i + half] : v.v[i];
          v.v[i] = keep + shfl_xor_f(send, (uint32_t)o);
        }
      }
      cnt = half;
    } else {
      v.v[0] += shfl_xor_f(v.v[0], (uint32_t)o);
    }
  }
  return v.v[0];
}
"""

METAL_HEADER = r"""
#include <metal_stdlib>
using namespace metal;
#define DEVICE device
#define SHARED threadgroup
#define SHARED_PTR(T) threadgroup T*
#define INLINE inline
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define UNROLL _Pragma("clang loop unroll(full)")
#define F32(x) static_cast<float>(x)
#define NEG_BIG (-3.0e38f)
typedef half half_t;
INLINE half_t to_half(float x) { return half(x); }
struct f4 { float v[4]; };
struct f8 { float v[8]; };
INLINE float warp_sum(float x) { return simd_sum(x); }
INLINE float warp_max(float x) { return simd_max(x); }
INLINE void warp_sync() { simdgroup_barrier(mem_flags::mem_none); }
INLINE float fma_keep(float a, float b, float c) { return metal::fma(a, b, c); }
INLINE float exp_f(float x) { return metal::exp(x); }
INLINE float sqrt_f(float x) { return metal::sqrt(x); }
// Metal has no log1p: log(u) * x / (u - 1), u = 1 + x, is exact to a few ulp (Goldberg's form)
INLINE float log1p_f(float x) { const float u = 1.0f + x; return u == 1.0f ? x : metal::log(u) * (x / (u - 1.0f)); }
#ifndef __METAL_VERSION__
template <typename T, typename U> T as_type(U);  // Metal's own; declared for the g++ syntax check
#endif
INLINE float bits_f32(uint32_t u) { return as_type<float>(u); }
INLINE uint32_t f32_bits(float f) { return as_type<uint32_t>(f); }
INLINE uint32_t opaque(uint32_t u) { return u; }
INLINE f4 load_f4(const device float* p) {
  const float4 a = *(const device float4*)p;
  f4 r; r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
  return r;
}
INLINE f8 load_h8(const device half* p) {
  const float4 a = float4(*(const device half4*)p);
  const float4 b = float4(*(const device half4*)(p + 4));
  f8 r;
  r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
  r.v[4] = b.x; r.v[5] = b.y; r.v[6] = b.z; r.v[7] = b.w;
  return r;
}
INLINE float h16_f32(uint16_t b) { return static_cast<float>(as_type<half>(b)); }
INLINE uint32_t f16_bits(half_t h) { return (uint32_t)as_type<uint16_t>(h); }
INLINE f4 mma_16816(f4 c, const threadgroup uint16_t* a, uint32_t lda, const threadgroup uint16_t* b, uint32_t ldb,
                    uint32_t lane) {
  const uint32_t g = lane >> 2, t = (lane & 3u) * 2u;
  for (int i = 0; i < 4; ++i) {
    const uint32_t row = g + (i >= 2 ? 8u : 0u), col = t + (uint32_t)(i & 1);
    float s = 0.0f;
    for (uint32_t k = 0; k < 16u; ++k) s += h16_f32(a[row * lda + k]) * h16_f32(b[col * ldb + k]);
    c.v[i] += s;
  }
  return c;
}
struct afrag { const threadgroup uint16_t* a; uint32_t lda; };
INLINE afrag mma_a_frag(const threadgroup uint16_t* a, uint32_t lda, uint32_t lane) {
  afrag f; f.a = a; f.lda = lda; return f;
}
INLINE f4 mma_16816_frag(f4 c, afrag fa, const threadgroup uint16_t* b, uint32_t ldb, uint32_t lane) {
  return mma_16816(c, fa.a, fa.lda, b, ldb, lane);
}
// ldmatrix's twins: the fragments as pointers, read by the four dot products (Metal: compile-checked, not run)
struct bfrag2 { const threadgroup uint16_t* b; uint32_t ldb; };
INLINE afrag mma_a_ldm(const threadgroup uint16_t* a, uint32_t lda, uint32_t lane) { return mma_a_frag(a, lda, lane); }
INLINE bfrag2 mma_b2_ldm(const threadgroup uint16_t* b, uint32_t ldb, uint32_t lane) {
  bfrag2 f; f.b = b; f.ldb = ldb; return f;
}
INLINE f4 mma_16816_ab(f4 c, afrag fa, bfrag2 fb, int j, uint32_t lane) {
  return mma_16816(c, fa.a, fa.lda, fb.b + (uint32_t)(8 * j) * fb.ldb, fb.ldb, lane);
}
INLINE float shfl_xor_f(float x, uint32_t m) { return simd_shuffle_xor(x, (ushort)m); }
INLINE float shfl_f(float x, uint32_t src) { return simd_shuffle(x, (ushort)src); }
""" + _SPREAD_XOR + r"""#define BREG_XCHG 1
struct u16w { uint32_t v[16]; };
INLINE void breg_publish(threadgroup uint32_t* xw, u16w w, uint32_t lane) {
  for (int i = 0; i < 16; ++i) xw[lane * 16u + (uint32_t)i] = w.v[i];
  simdgroup_barrier(mem_flags::mem_threadgroup);
}
INLINE f4 mma_16816_ar(f4 c, afrag fa, uint32_t b0, uint32_t b1, const threadgroup uint32_t* wx, int slot, uint32_t lane) {
  const uint32_t g = lane >> 2, t = (lane & 3u) * 2u;
  for (int i = 0; i < 4; ++i) {
    const uint32_t row = g + (i >= 2 ? 8u : 0u), col = t + (uint32_t)(i & 1);
    float s = 0.0f;
    for (uint32_t k = 0; k < 16u; ++k) {
      const uint32_t w = wx[(col * 4u + (k & 7u) / 2u) * 16u + (uint32_t)slot + (k >> 3)];
      s += h16_f32(fa.a[row * fa.lda + k]) * h16_f32((uint16_t)((k & 1u) ? w >> 16 : w & 0xffffu));
    }
    c.v[i] += s;
  }
  return c;
}
struct fx16 { float v[16]; };
INLINE fx16 shfl_xor_fx16(fx16 x, uint32_t m) {
  for (int i = 0; i < 16; ++i) x.v[i] = simd_shuffle_xor(x.v[i], (ushort)m);
  return x;
}
""" + _PORTABLE_HELPERS

METAL_BODY = r"""
  const uint32_t tid = thread_position_in_threadgroup.x;
  const uint32_t bx = threadgroup_position_in_grid.x;
  const uint32_t by = threadgroup_position_in_grid.y;
  const uint32_t bz = threadgroup_position_in_grid.z;
  const uint32_t lane = thread_index_in_simdgroup;
  const uint32_t warp_id = simdgroup_index_in_threadgroup;
"""

CUDA_HEADER = r"""
#define DEVICE
#define SHARED __shared__
#define SHARED_PTR(T) T*
#define INLINE __device__ __forceinline__
#define BARRIER() __syncthreads()
#define UNROLL _Pragma("unroll")
#define NEG_BIG (-3.0e38f)
typedef __half half_t;
struct f4 { float v[4]; };
struct f8 { float v[8]; };
// __half2float, not a cast: MLX may build with __CUDA_NO_HALF_CONVERSIONS__
INLINE float F32(float x) { return x; }
INLINE float F32(__half x) { return __half2float(x); }
INLINE float F32(int x) { return static_cast<float>(x); }
INLINE float F32(unsigned int x) { return static_cast<float>(x); }
INLINE __half to_half(float x) { return __float2half_rn(x); }
INLINE uint32_t f16_bits(__half h) { return (uint32_t)__half_as_ushort(h); }
INLINE float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return __shfl_sync(0xffffffffu, x, 0);  // one lane's bits for all: lanes may sum in other orders
}
INLINE float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
INLINE void warp_sync() { __syncwarp(); }
// phases.py's one-launch chains (CUDA and the emulator only): a block's ticket, a phase's
// completion count, and the wait for a count; volatile reads and a device fence, the pattern
// of CUDA's threadFenceReduction sample
INLINE uint32_t atomic_add_u32(uint32_t* p, uint32_t v) { return atomicAdd(p, v); }
INLINE void fence_device() { __threadfence(); }
INLINE void wait_count(const uint32_t* p, uint32_t n) {
  while (*(const volatile uint32_t*)p < n) __nanosleep(32);
  __threadfence();
}
// a value another block of this launch wrote (and fenced): read from L2, past this SM's L1
INLINE float load_coherent(const float* p) { return __ldcg(p); }
// fma.rn.f32 without .ftz: subnormal operands and results kept even under -ftz / fast math
INLINE float fma_keep(float a, float b, float c) { float d; asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c)); return d; }
INLINE float exp_f(float x) { return expf(x); }
INLINE float sqrt_f(float x) { return sqrtf(x); }
INLINE float log1p_f(float x) { return log1pf(x); }
INLINE float bits_f32(uint32_t u) { union { uint32_t u; float f; } c; c.u = u; return c.f; }  // a register move
INLINE uint32_t f32_bits(float f) { return __float_as_uint(f); }
INLINE uint32_t opaque(uint32_t u) { asm("" : "+r"(u)); return u; }  // no instruction: hides u's bits from ptxas
INLINE f4 load_f4(const float* p) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  f4 r; r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
  return r;
}
INLINE f8 load_h8(const __half* p) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
  f8 r;
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    r.v[2 * i] = f.x; r.v[2 * i + 1] = f.y;
  }
  return r;
}
INLINE f8 h8_f8(uint4 u) {
  const __half2* h = reinterpret_cast<const __half2*>(&u);
  f8 r;
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    r.v[2 * i] = f.x; r.v[2 * i + 1] = f.y;
  }
  return r;
}
// the tensor-core m16n8k16 (sm_80+): A's four registers hold rows g / g + 8, columns 2t.. / 2t + 8..;
// B's two hold column g, rows 2t.. and 2t + 8..; C's four: rows g, g + 8, columns 2t, 2t + 1
INLINE f4 mma_16816(f4 c, const uint16_t* a, uint32_t lda, const uint16_t* b, uint32_t ldb, uint32_t lane) {
  const uint32_t g = lane >> 2, t = (lane & 3u) * 2u;
  const uint32_t a0 = *reinterpret_cast<const uint32_t*>(a + g * lda + t);
  const uint32_t a1 = *reinterpret_cast<const uint32_t*>(a + (g + 8u) * lda + t);
  const uint32_t a2 = *reinterpret_cast<const uint32_t*>(a + g * lda + t + 8u);
  const uint32_t a3 = *reinterpret_cast<const uint32_t*>(a + (g + 8u) * lda + t + 8u);
  const uint32_t b0 = *reinterpret_cast<const uint32_t*>(b + g * ldb + t);
  const uint32_t b1 = *reinterpret_cast<const uint32_t*>(b + g * ldb + t + 8u);
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c.v[0]), "+f"(c.v[1]), "+f"(c.v[2]), "+f"(c.v[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  return c;
}
struct afrag { uint32_t r[4]; };  // a lane's A registers of one m16n8k16 step, loaded once for many B tiles
INLINE afrag mma_a_frag(const uint16_t* a, uint32_t lda, uint32_t lane) {
  const uint32_t g = lane >> 2, t = (lane & 3u) * 2u;
  afrag f;
  f.r[0] = *reinterpret_cast<const uint32_t*>(a + g * lda + t);
  f.r[1] = *reinterpret_cast<const uint32_t*>(a + (g + 8u) * lda + t);
  f.r[2] = *reinterpret_cast<const uint32_t*>(a + g * lda + t + 8u);
  f.r[3] = *reinterpret_cast<const uint32_t*>(a + (g + 8u) * lda + t + 8u);
  return f;
}
INLINE f4 mma_16816_frag(f4 c, afrag fa, const uint16_t* b, uint32_t ldb, uint32_t lane) {
  const uint32_t g = lane >> 2, t = (lane & 3u) * 2u;
  const uint32_t b0 = *reinterpret_cast<const uint32_t*>(b + g * ldb + t);
  const uint32_t b1 = *reinterpret_cast<const uint32_t*>(b + g * ldb + t + 8u);
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c.v[0]), "+f"(c.v[1]), "+f"(c.v[2]), "+f"(c.v[3])
               : "r"(fa.r[0]), "r"(fa.r[1]), "r"(fa.r[2]), "r"(fa.r[3]), "r"(b0), "r"(b1));
  return c;
}
INLINE uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) { return __byte_perm(x, y, s); }  // one PRMT
// hi = f16(a), f16(b) and lo = f16(a - hi), f16(b - hi) as two words (a in the low halves): one
// cvt.rn.f16x2.f32 a word (to nearest even, as __float2half_rn) instead of two conversions and a pack
INLINE uint2 split_h2(float a, float b) {
  uint32_t h, l;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(b), "f"(a));
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(l) : "f"(b - f.y), "f"(a - f.x));
  uint2 r;
  r.x = h;
  r.y = l;
  return r;
}
// ldmatrix.x4 (sm_75+): lane l gives the address of row l % 8 of matrix l / 8; register i of every lane
// is then its m16n8k16 fragment of matrix i (row lane / 4, columns 2 (lane % 4)..). One instruction
// where the 32-bit loads took four (A) or two per n-tile (B); the same bytes, so the same wavefronts
INLINE uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
INLINE afrag mma_a_ldm(const uint16_t* a, uint32_t lda, uint32_t lane) {  // matrices: rows 0-7 | 8-15, k 0-7 | 8-15
  afrag f;
  const uint32_t p = smem_u32(a + (lane & 15u) * lda + (lane >> 4) * 8u);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3]) : "r"(p));
  return f;
}
struct bfrag2 { uint32_t r[4]; };  // b0, b1 of n-tile 0 (B rows 0-7), then of n-tile 1 (rows 8-15)
INLINE bfrag2 mma_b2_ldm(const uint16_t* b, uint32_t ldb, uint32_t lane) {  // matrix i: rows 8 (i / 2).., k 8 (i % 2)..
  bfrag2 f;
  const uint32_t p = smem_u32(b + ((lane & 7u) + ((lane >> 4) << 3)) * ldb + ((lane >> 3) & 1u) * 8u);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3]) : "r"(p));
  return f;
}
INLINE f4 mma_16816_ab(f4 c, afrag fa, bfrag2 fb, int j, uint32_t lane) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c.v[0]), "+f"(c.v[1]), "+f"(c.v[2]), "+f"(c.v[3])
               : "r"(fa.r[0]), "r"(fa.r[1]), "r"(fa.r[2]), "r"(fa.r[3]), "r"(fb.r[2 * j]), "r"(fb.r[2 * j + 1]));
  return c;
}
INLINE float shfl_xor_f(float x, uint32_t m) { return __shfl_xor_sync(0xffffffffu, x, (int)m); }
INLINE float shfl_f(float x, uint32_t src) { return __shfl_sync(0xffffffffu, x, (int)src); }
""" + _SPREAD_XOR + r"""#define BREG_XCHG 0
struct u16w { uint32_t v[16]; };
INLINE void breg_publish(uint32_t* xw, u16w w, uint32_t lane) {}  // the registers are the fragments
INLINE f4 mma_16816_ar(f4 c, afrag fa, uint32_t b0, uint32_t b1, const uint32_t* xw, int slot, uint32_t lane) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c.v[0]), "+f"(c.v[1]), "+f"(c.v[2]), "+f"(c.v[3])
               : "r"(fa.r[0]), "r"(fa.r[1]), "r"(fa.r[2]), "r"(fa.r[3]), "r"(b0), "r"(b1));
  return c;
}
struct fx16 { float v[16]; };
INLINE fx16 shfl_xor_fx16(fx16 x, uint32_t m) {
  for (int i = 0; i < 16; ++i) x.v[i] = __shfl_xor_sync(0xffffffffu, x.v[i], (int)m);
  return x;
}
"""

CUDA_BODY = r"""
  const uint32_t tid = threadIdx.x;
  const uint32_t bx = blockIdx.x;
  const uint32_t by = blockIdx.y;
  const uint32_t bz = blockIdx.z;
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp_id = threadIdx.x >> 5;
"""

# The emulator's runtime (EmuCtx, barriers, half) is in emulate.py; this is its kernel-facing side.
EMU_HEADER = r"""
#define DEVICE
#define SHARED static
#define SHARED_PTR(T) T*
#define INLINE inline
#define BARRIER() strata_emu::ctx->barrier()
#define UNROLL
#define F32(x) static_cast<float>(x)
#define NEG_BIG (-3.0e38f)
typedef strata_emu::half half_t;
INLINE half_t to_half(float x) { return strata_emu::half::from_float(x); }
INLINE uint32_t f16_bits(half_t h) { return (uint32_t)h.bits; }
struct f4 { float v[4]; };
struct f8 { float v[8]; };
struct uint2 { uint32_t x, y; };
struct uint4 { uint32_t x, y, z, w; };
INLINE float warp_sum(float x) { return strata_emu::ctx->warp_sum(x); }
INLINE float warp_max(float x) { return strata_emu::ctx->warp_max(x); }
INLINE void warp_sync() { strata_emu::ctx->blk->warp_bars[strata_emu::ctx->tid >> 5]->arrive_and_wait(); }
// blocks run one after another in ticket order: a count waited for is complete, or the chain is wrong
INLINE uint32_t atomic_add_u32(uint32_t* p, uint32_t v) { const uint32_t o = *p; *p = o + v; return o; }
INLINE void fence_device() {}
INLINE void wait_count(const uint32_t* p, uint32_t n) { if (*p < n) strata_emu::sched_fail(4); }
INLINE float load_coherent(const float* p) { return *p; }
INLINE float fma_keep(float a, float b, float c) { return std::fma(a, b, c); }
INLINE float exp_f(float x) { return std::exp(x); }
INLINE float sqrt_f(float x) { return std::sqrt(x); }
INLINE float log1p_f(float x) { return std::log1p(x); }
INLINE float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
INLINE uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
INLINE uint32_t opaque(uint32_t u) { return u; }
INLINE f4 load_f4(const float* p) {
  f4 r; for (int i = 0; i < 4; ++i) r.v[i] = p[i];
  return r;
}
INLINE f8 load_h8(const half_t* p) {
  f8 r; for (int i = 0; i < 8; ++i) r.v[i] = F32(p[i]);
  return r;
}
INLINE float h16_f32(uint16_t b) { return static_cast<float>(strata_emu::half{b}); }
INLINE f4 mma_16816(f4 c, const uint16_t* a, uint32_t lda, const uint16_t* b, uint32_t ldb, uint32_t lane) {
  const uint32_t g = lane >> 2, t = (lane & 3u) * 2u;
  for (int i = 0; i < 4; ++i) {
    const uint32_t row = g + (i >= 2 ? 8u : 0u), col = t + (uint32_t)(i & 1);
    float s = 0.0f;
    for (uint32_t k = 0; k < 16u; ++k) s += h16_f32(a[row * lda + k]) * h16_f32(b[col * ldb + k]);
    c.v[i] += s;
  }
  return c;
}
struct afrag { const uint16_t* a; uint32_t lda; };
INLINE afrag mma_a_frag(const uint16_t* a, uint32_t lda, uint32_t lane) { afrag f; f.a = a; f.lda = lda; return f; }
INLINE f4 mma_16816_frag(f4 c, afrag fa, const uint16_t* b, uint32_t ldb, uint32_t lane) {
  return mma_16816(c, fa.a, fa.lda, b, ldb, lane);
}
// ldmatrix's twins: the fragments as pointers, read by the four dot products (the same values)
struct bfrag2 { const uint16_t* b; uint32_t ldb; };
INLINE afrag mma_a_ldm(const uint16_t* a, uint32_t lda, uint32_t lane) { return mma_a_frag(a, lda, lane); }
INLINE bfrag2 mma_b2_ldm(const uint16_t* b, uint32_t ldb, uint32_t lane) { bfrag2 f; f.b = b; f.ldb = ldb; return f; }
INLINE f4 mma_16816_ab(f4 c, afrag fa, bfrag2 fb, int j, uint32_t lane) {
  return mma_16816(c, fa.a, fa.lda, fb.b + (uint32_t)(8 * j) * fb.ldb, fb.ldb, lane);
}
INLINE float shfl_xor_f(float x, uint32_t m) {  // through the block's per-thread buffer, between two warp barriers
  strata_emu::Ctx* c = strata_emu::ctx;
  c->blk->buf[c->tid] = x;
  c->blk->warp_bars[c->tid >> 5]->arrive_and_wait();
  const float r = c->blk->buf[(c->tid & ~31u) | ((c->tid & 31u) ^ m)];
  c->blk->warp_bars[c->tid >> 5]->arrive_and_wait();
  return r;
}
INLINE float shfl_f(float x, uint32_t src) {  // through the block's per-thread buffer, as shfl_xor_f
  strata_emu::Ctx* c = strata_emu::ctx;
  c->blk->buf[c->tid] = x;
  c->blk->warp_bars[c->tid >> 5]->arrive_and_wait();
  const float r = c->blk->buf[(c->tid & ~31u) | (src & 31u)];
  c->blk->warp_bars[c->tid >> 5]->arrive_and_wait();
  return r;
}
struct fx32 { float v[32]; };
INLINE float warp_sums_spread(fx32 v, int p2, uint32_t lane) {  // each value summed in warp_sum's (lane) order here
  static float sb[1024 * 32];  // blocks run one after another: one buffer serves them all
  strata_emu::Ctx* c = strata_emu::ctx;
  for (int i = 0; i < p2; ++i) sb[c->tid * 32u + (uint32_t)i] = v.v[i];
  c->blk->warp_bars[c->tid >> 5]->arrive_and_wait();
  const int sh = p2 >= 32 ? 0 : p2 >= 16 ? 1 : p2 >= 8 ? 2 : p2 >= 4 ? 3 : p2 >= 2 ? 4 : 5;
  const uint32_t idx = lane >> sh, base = c->tid & ~31u;
  float r = sb[base * 32u + idx];
  for (uint32_t k = 1; k < 32u; ++k) r += sb[(base + k) * 32u + idx];
  c->blk->warp_bars[c->tid >> 5]->arrive_and_wait();
  return r;
}
#define BREG_XCHG 1
struct u16w { uint32_t v[16]; };
INLINE void breg_publish(uint32_t* xw, u16w w, uint32_t lane) {
  for (int i = 0; i < 16; ++i) xw[lane * 16u + (uint32_t)i] = w.v[i];
  strata_emu::ctx->blk->warp_bars[strata_emu::ctx->tid >> 5]->arrive_and_wait();
}
INLINE f4 mma_16816_ar(f4 c, afrag fa, uint32_t b0, uint32_t b1, const uint32_t* wx, int slot, uint32_t lane) {
  const uint32_t g = lane >> 2, t = (lane & 3u) * 2u;
  for (int i = 0; i < 4; ++i) {
    const uint32_t row = g + (i >= 2 ? 8u : 0u), col = t + (uint32_t)(i & 1);
    float s = 0.0f;
    for (uint32_t k = 0; k < 16u; ++k) {  // B[col][k]: lane 4 col + (k % 8) / 2's word b0 (k < 8) or b1
      const uint32_t w = wx[(col * 4u + (k & 7u) / 2u) * 16u + (uint32_t)slot + (k >> 3)];
      s += h16_f32(fa.a[row * fa.lda + k]) * h16_f32((uint16_t)((k & 1u) ? w >> 16 : w & 0xffffu));
    }
    c.v[i] += s;
  }
  return c;
}
struct fx16 { float v[16]; };
INLINE fx16 shfl_xor_fx16(fx16 x, uint32_t m) {  // one exchange (two warp barriers) for the 16 floats
  static float xb[1024 * 16];  // blocks run one after another: one buffer serves them all
  strata_emu::Ctx* c = strata_emu::ctx;
  for (int i = 0; i < 16; ++i) xb[c->tid * 16u + (uint32_t)i] = x.v[i];
  c->blk->warp_bars[c->tid >> 5]->arrive_and_wait();
  const uint32_t from = ((c->tid & ~31u) | ((c->tid & 31u) ^ m)) * 16u;
  for (int i = 0; i < 16; ++i) x.v[i] = xb[from + (uint32_t)i];
  c->blk->warp_bars[c->tid >> 5]->arrive_and_wait();
  return x;
}
""" + _PORTABLE_HELPERS

EMU_BODY = r"""
  const uint32_t tid = strata_emu::ctx->tid;
  const uint32_t bx = strata_emu::ctx->bx;
  const uint32_t by = strata_emu::ctx->by;
  const uint32_t bz = strata_emu::ctx->bz;
  const uint32_t lane = strata_emu::ctx->tid & 31u;
  const uint32_t warp_id = strata_emu::ctx->tid >> 5;
  (void)bx; (void)by; (void)bz; (void)lane; (void)warp_id;
"""

HEADER = {Dialect.METAL: METAL_HEADER, Dialect.CUDA: CUDA_HEADER, Dialect.EMU: EMU_HEADER}
BODY = {Dialect.METAL: METAL_BODY, Dialect.CUDA: CUDA_BODY, Dialect.EMU: EMU_BODY}

WARP = 32  # lanes per simdgroup / warp: Apple GPUs and NVIDIA GPUs alike
