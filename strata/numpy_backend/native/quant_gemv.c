/* Quantized GEMV on the CPU: y[t] = W x[t] with W as strata stores it, x and y float32.
 *
 * Q8_0, Q4_0, Q2_0: two planes, the codes, then one float16 scale d per block of 32 weights.
 * llama.cpp's Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS, MXFP4 and Q5_1: whole ggml blocks,
 * scales inside (the second half of this file).
 *
 * x stays float32 (no activation quantization, unlike ggml's q8_0 x q8_0 dot): each block's 32
 * products are summed in float32 and times the block's scale d; so against the reference (widen W
 * to float32, then a float32 matrix product) only the summation order differs.
 *
 * A block's signed levels (q for Q8_0, q - 8 for Q4_0, q - 2 for Q2_0) are unpacked to 32 int8,
 * then widened and multiplied with x in float32: AVX2 + FMA intrinsics where the build machine
 * has them (the levels unpacked in registers; 8 lanes, 4 multiply-adds per block; the row keeps
 * one 8-lane sum, reduced once at its end; with AVX-512 16 lanes, 2 multiply-adds per block, for
 * Q8_0, Q4_0 and Q2_0), a portable loop the compiler vectorizes elsewhere
 * (NEON on arm64: 16 lanes). Code layouts as strata.formats.quant_types defines them: Q8_0 32 int8;
 * Q4_0 16 bytes, weight j < 16 the low nibble of byte j, j >= 16 the high nibble of byte j - 16;
 * Q2_0 8 bytes, weight j at bits 2 (j % 4) of byte j / 4.
 *
 * Rows [r0, r1) only: a caller splits the rows over threads (each call touches its rows alone). */
#include <stdint.h>
#include <math.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define STRATA_AVX2 1
#endif

#define BLOCK 32
#define TILE 4 /* tokens one pass over a row serves (a prompt's rows, a decode window) */

static inline float half_to_float(uint16_t h) {
#if defined(STRATA_AVX2)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* ---------------------------------------------------------------- a block's 32 signed levels */

static inline void q8_0_levels(const uint8_t *restrict c, int8_t *restrict out) { memcpy(out, c, BLOCK); }

static inline void q4_0_levels(const uint8_t *restrict c, int8_t *restrict out) {
    for (int j = 0; j < 16; j++) {
        out[j] = (int8_t)((c[j] & 0x0f) - 8);
        out[j + 16] = (int8_t)((c[j] >> 4) - 8);
    }
}

static inline void q2_0_levels(const uint8_t *restrict c, int8_t *restrict out) {
    for (int j = 0; j < BLOCK; j++) out[j] = (int8_t)(((c[j >> 2] >> (2 * (j & 3))) & 3) - 2);
}

/* ---------------------------------------------------------------- one row's dot product */

#if defined(STRATA_AVX2)
static inline __m256 widen8(__m128i q8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)); }

/* a block's levels as two vectors of 16 int8 (weights 0-15, 16-31), unpacked in registers */
static inline void q8_0_levels_x(const uint8_t *c, __m128i *lo, __m128i *hi) {
    *lo = _mm_loadu_si128((const __m128i *)c);
    *hi = _mm_loadu_si128((const __m128i *)(c + 16));
}

static inline void q4_0_levels_x(const uint8_t *c, __m128i *lo, __m128i *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)c), m4 = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    *lo = _mm_sub_epi8(_mm_and_si128(b, m4), eight);
    *hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m4), eight);
}

static inline void q2_0_levels_x(const uint8_t *c, __m128i *lo, __m128i *hi) {
    /* t_k holds weight 4 i + k at byte i; interleaving bytes (t0, t1), (t2, t3), then those as
       16-bit pairs, puts weight j at byte j */
    const __m128i b = _mm_loadl_epi64((const __m128i *)c), m3 = _mm_set1_epi8(3), two = _mm_set1_epi8(2);
    const __m128i t0 = _mm_and_si128(b, m3), t1 = _mm_and_si128(_mm_srli_epi16(b, 2), m3);
    const __m128i t2 = _mm_and_si128(_mm_srli_epi16(b, 4), m3), t3 = _mm_and_si128(_mm_srli_epi16(b, 6), m3);
    const __m128i a01 = _mm_unpacklo_epi8(t0, t1), a23 = _mm_unpacklo_epi8(t2, t3);
    *lo = _mm_sub_epi8(_mm_unpacklo_epi16(a01, a23), two);
    *hi = _mm_sub_epi8(_mm_unpackhi_epi16(a01, a23), two);
}

#if defined(__AVX512F__)
/* AVX-512 where the build machine has it: a block's 32 levels widen in two 16-lane steps instead
 * of four 8-lane ones (the widening, not the memory, bounded a decode token's experts: a layer's
 * ran as fast from memory as from cache); one 16-lane sum per row */
static inline __m512 widen16(__m128i q8) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)); }
#define ROW_DOT(LEVELS, CODE_BYTES)                                                                  \
    static inline void LEVELS##_row(const uint8_t *c, const uint16_t *d, int64_t n_blocks,          \
                                    const float *x, int64_t n_cols, int nt, float *out) {            \
        __m512 acc[TILE];                                                                            \
        for (int t = 0; t < TILE; t++) acc[t] = _mm512_setzero_ps();                                 \
        for (int64_t b = 0; b < n_blocks; b++, c += (CODE_BYTES)) {                                  \
            __m128i lo, hi;                                                                          \
            LEVELS##_x(c, &lo, &hi);                                                                 \
            const __m512 w0 = widen16(lo), w1 = widen16(hi);                                         \
            const __m512 db = _mm512_set1_ps(half_to_float(d[b]));                                   \
            for (int t = 0; t < nt; t++) {                                                           \
                const float *xb = x + t * n_cols + b * BLOCK;                                        \
                __m512 p = _mm512_mul_ps(w0, _mm512_loadu_ps(xb));                                   \
                p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), p);                                \
                acc[t] = _mm512_fmadd_ps(db, p, acc[t]);                                             \
            }                                                                                        \
        }                                                                                            \
        for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(acc[t]);                          \
    }
#else
/* one row against up to TILE tokens: each block's levels are widened once for all of them */
#define ROW_DOT(LEVELS, CODE_BYTES)                                                                  \
    static inline void LEVELS##_row(const uint8_t *c, const uint16_t *d, int64_t n_blocks,          \
                                    const float *x, int64_t n_cols, int nt, float *out) {            \
        __m256 acc[TILE];                                                                            \
        for (int t = 0; t < TILE; t++) acc[t] = _mm256_setzero_ps();                                 \
        for (int64_t b = 0; b < n_blocks; b++, c += (CODE_BYTES)) {                                  \
            __m128i lo, hi;                                                                          \
            LEVELS##_x(c, &lo, &hi);                                                                 \
            const __m256 w0 = widen8(lo), w1 = widen8(_mm_srli_si128(lo, 8));                        \
            const __m256 w2 = widen8(hi), w3 = widen8(_mm_srli_si128(hi, 8));                        \
            const __m256 db = _mm256_set1_ps(half_to_float(d[b]));                                   \
            for (int t = 0; t < nt; t++) {                                                           \
                const float *xb = x + t * n_cols + b * BLOCK;                                        \
                __m256 p = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));                                   \
                p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), p);                                 \
                p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), p);                                \
                p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), p);                                \
                acc[t] = _mm256_fmadd_ps(db, p, acc[t]);                                             \
            }                                                                                        \
        }                                                                                            \
        for (int t = 0; t < nt; t++) {                                                               \
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1)); \
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                                  \
            s = _mm_add_ss(s, _mm_movehdup_ps(s));                                                   \
            out[t] = _mm_cvtss_f32(s);                                                               \
        }                                                                                            \
    }
#endif /* AVX-512 */
#else
#define LANES 16 /* partial sums the compiler keeps in vector registers (no -ffast-math needed) */
#define ROW_DOT(LEVELS, CODE_BYTES)                                                                  \
    static inline void LEVELS##_row(const uint8_t *c, const uint16_t *d, int64_t n_blocks,          \
                                    const float *x, int64_t n_cols, int nt, float *out) {            \
        float acc[TILE][LANES] = {{0}};                                                              \
        int8_t lv[BLOCK];                                                                            \
        for (int64_t b = 0; b < n_blocks; b++, c += (CODE_BYTES)) {                                  \
            LEVELS(c, lv);                                                                           \
            const float db = half_to_float(d[b]);                                                    \
            for (int t = 0; t < nt; t++) {                                                           \
                const float *xb = x + t * n_cols + b * BLOCK;                                        \
                float p[LANES];                                                                      \
                for (int j = 0; j < LANES; j++) p[j] = (float)lv[j] * xb[j] + (float)lv[j + LANES] * xb[j + LANES]; \
                for (int j = 0; j < LANES; j++) acc[t][j] += db * p[j];                              \
            }                                                                                        \
        }                                                                                            \
        for (int t = 0; t < nt; t++) {                                                               \
            for (int w = LANES / 2; w; w /= 2)                                                       \
                for (int j = 0; j < w; j++) acc[t][j] += acc[t][j + w];                              \
            out[t] = acc[t][0];                                                                      \
        }                                                                                            \
    }
#endif

ROW_DOT(q8_0_levels, 32)
ROW_DOT(q4_0_levels, 16)
ROW_DOT(q2_0_levels, 8)

/* ---------------------------------------------------------------- the entry points */

/* rows [r0, r1) of y[t, r] = sum_b d[r, b] * sum_j level(r, b, j) x[t, 32 b + j], t < n_tokens.
 * codes [n_rows, n_cols / 32 * CODE_BYTES] uint8, scales [n_rows, n_cols / 32] float16 bits,
 * x [n_tokens, n_cols] float32, y [n_tokens, n_rows] float32, all C-contiguous. */
#define DEFINE_GEMV(NAME, LEVELS, CODE_BYTES)                                                        \
    void NAME(const uint8_t *codes, const uint16_t *scales, int64_t n_rows, int64_t n_cols,         \
              const float *x, int64_t n_tokens, float *y, int64_t r0, int64_t r1) {                  \
        const int64_t n_blocks = n_cols / BLOCK;                                                     \
        float out[TILE];                                                                             \
        for (int64_t r = r0; r < r1; r++)                                                            \
            for (int64_t t0 = 0; t0 < n_tokens; t0 += TILE) {                                        \
                const int nt = n_tokens - t0 < TILE ? (int)(n_tokens - t0) : TILE;                   \
                LEVELS##_row(codes + r * n_blocks * (CODE_BYTES), scales + r * n_blocks, n_blocks,   \
                             x + t0 * n_cols, n_cols, nt, out);                                      \
                for (int t = 0; t < nt; t++) y[(t0 + t) * n_rows + r] = out[t];                      \
            }                                                                                        \
    }

DEFINE_GEMV(strata_q8_0_gemv, q8_0_levels, 32)
DEFINE_GEMV(strata_q4_0_gemv, q4_0_levels, 16)
DEFINE_GEMV(strata_q2_0_gemv, q2_0_levels, 8)

/* ================================================================ llama.cpp's block types, as stored
 *
 * Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS, MXFP4 (ggml's) and Q5_1, each row a run of whole
 * ggml blocks (scales inside; the scales plane is empty), layouts as strata/formats/ggml_blocks.py
 * defines them. Every type is read as units of 32 weights (a 32-weight block is one unit, a
 * 256-weight super-block eight): a unit gives its 32 small signed levels and, for each half of 16
 * weights, a scale a and an offset o, so that weight j = a * level_j + o. Without an offset
 * the levels multiply x as the 32-weight types' above (widened to float32, FMA with x) and each
 * half's sum is scaled by its a (one multiply-add per unit where a_lo = a_hi, two where the scales
 * cover 16 weights). With one (K-quants' -dmin * m, Q5_1's m) the unit's 32 weights are built in
 * float32 first, a * level + o in one fused multiply-add (the reference rounds a * level first:
 * at most an ulp of each weight apart), then multiplied with x: faster than keeping the offsets
 * apart as o * (x's 16-weight sums), whose scalar sum per token chained through memory (a 2048 x
 * 2048 Q4_K GEMV: 0.495 against 0.696 ms; docs/cpu.md). a and o are computed as the reference
 * computes them (d * sc, dmin * m in float32). A super-block's 8 units are unrolled, so each
 * unit's shifts and masks are constants. Portable builds (no AVX2) build every unit's weights
 * a * level + o in float32 and multiply them with x. */

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* e2m1 values doubled; the half lives in the e8m0 scale (ggml's GGML_E8M0_TO_FP32_HALF) */
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if defined(__GNUC__) && !defined(__clang__)
#define UNROLL_UNITS _Pragma("GCC unroll 8")
#elif defined(__clang__)
#define UNROLL_UNITS _Pragma("unroll 8")
#else
#define UNROLL_UNITS
#endif

/* ---------------------------------------------------------------- each unit's scales and offsets
 * blk: the block (super-block) start; u: the unit in it; a[2], o[2]: the halves' scale, offset */

static inline void k4_scale_min(const uint8_t *s, int u, int *sc, int *m) { /* ggml's get_scale_min_k4 */
    if (u < 4) {
        *sc = s[u] & 63;
        *m = s[u + 4] & 63;
    } else {
        *sc = (s[u + 4] & 0xF) | ((s[u - 4] >> 6) << 4);
        *m = (s[u + 4] >> 4) | ((s[u] >> 6) << 4);
    }
}

static inline void q4_k_scales(const uint8_t *blk, int u, float *a, float *o) { /* also Q5_K */
    int sc, m;
    k4_scale_min(blk + 4, u, &sc, &m);
    a[0] = a[1] = f16_at(blk) * (float)sc;
    o[0] = o[1] = -(f16_at(blk + 2) * (float)m);
}
#define q5_k_scales q4_k_scales

static inline void q6_k_scales(const uint8_t *blk, int u, float *a, float *o) {
    const float d = f16_at(blk + 208);
    a[0] = d * (float)(int8_t)blk[192 + 2 * u];
    a[1] = d * (float)(int8_t)blk[192 + 2 * u + 1];
    o[0] = o[1] = 0.0f;
}

static inline int q3_k_scale(const uint8_t *s, int k) {
    return (((s[k % 8] >> (4 * (k / 8))) & 0xF) | (((s[8 + k % 4] >> (2 * (k / 4))) & 3) << 4)) - 32;
}

static inline void q3_k_scales(const uint8_t *blk, int u, float *a, float *o) {
    const float d = f16_at(blk + 108);
    a[0] = d * (float)q3_k_scale(blk + 96, 2 * u);
    a[1] = d * (float)q3_k_scale(blk + 96, 2 * u + 1);
    o[0] = o[1] = 0.0f;
}

static inline void q2_k_scales(const uint8_t *blk, int u, float *a, float *o) {
    const float d = f16_at(blk + 80), dmin = f16_at(blk + 82);
    for (int h = 0; h < 2; h++) {
        const uint8_t s = blk[2 * u + h];
        a[h] = d * (float)(s & 0xF);
        o[h] = -(dmin * (float)(s >> 4));
    }
}

static inline void iq4_nl_scales(const uint8_t *blk, int u, float *a, float *o) {
    (void)u;
    a[0] = a[1] = f16_at(blk);
    o[0] = o[1] = 0.0f;
}

static inline void iq4_xs_scales(const uint8_t *blk, int u, float *a, float *o) {
    uint16_t sh;
    memcpy(&sh, blk + 2, 2);
    const int ls = ((blk[4 + u / 2] >> (4 * (u % 2))) & 0xF) | (((sh >> (2 * u)) & 3) << 4);
    a[0] = a[1] = f16_at(blk) * (float)(ls - 32);
    o[0] = o[1] = 0.0f;
}

static inline void mxfp4_scales(const uint8_t *blk, int u, float *a, float *o) {
    (void)u;
    a[0] = a[1] = e8m0_half(blk[0]);
    o[0] = o[1] = 0.0f;
}

static inline void q5_1_scales(const uint8_t *blk, int u, float *a, float *o) {
    (void)u;
    a[0] = a[1] = f16_at(blk);
    o[0] = o[1] = f16_at(blk + 2);
}

/* ---------------------------------------------------------------- each unit's 32 levels, portable */

static inline void q4_k_levels(const uint8_t *blk, int u, int8_t *out) {
    const uint8_t *qs = blk + 16 + 32 * (u / 2);
    const int sh = 4 * (u % 2);
    for (int l = 0; l < BLOCK; l++) out[l] = (int8_t)((qs[l] >> sh) & 0xF);
}

static inline void q5_k_levels(const uint8_t *blk, int u, int8_t *out) {
    const uint8_t *qh = blk + 16, *qs = blk + 48 + 32 * (u / 2);
    const int sh = 4 * (u % 2);
    for (int l = 0; l < BLOCK; l++) out[l] = (int8_t)(((qs[l] >> sh) & 0xF) | (((qh[l] >> u) & 1) << 4));
}

static inline void q6_k_levels(const uint8_t *blk, int u, int8_t *out) {
    const int h = u / 4, k = u % 4;
    const uint8_t *ql = blk + 64 * h + 32 * (k % 2), *qh = blk + 128 + 32 * h;
    for (int l = 0; l < BLOCK; l++)
        out[l] = (int8_t)((((ql[l] >> (4 * (k / 2))) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32);
}

static inline void q3_k_levels(const uint8_t *blk, int u, int8_t *out) {
    const int h = u / 4, j = u % 4;
    const uint8_t *hmask = blk, *qs = blk + 32 + 32 * h;
    for (int l = 0; l < BLOCK; l++)
        out[l] = (int8_t)(((qs[l] >> (2 * j)) & 3) - ((hmask[l] >> u) & 1 ? 0 : 4));
}

static inline void q2_k_levels(const uint8_t *blk, int u, int8_t *out) {
    const int h = u / 4, j = u % 4;
    const uint8_t *qs = blk + 16 + 32 * h;
    for (int l = 0; l < BLOCK; l++) out[l] = (int8_t)((qs[l] >> (2 * j)) & 3);
}

static inline void table_levels(const uint8_t *qs, const int8_t *table, int8_t *out) {
    for (int l = 0; l < 16; l++) {
        out[l] = table[qs[l] & 0xF];
        out[l + 16] = table[qs[l] >> 4];
    }
}

static inline void iq4_nl_levels(const uint8_t *blk, int u, int8_t *out) { (void)u; table_levels(blk + 2, KVALUES_IQ4NL, out); }
static inline void iq4_xs_levels(const uint8_t *blk, int u, int8_t *out) { table_levels(blk + 8 + 16 * u, KVALUES_IQ4NL, out); }
static inline void mxfp4_levels(const uint8_t *blk, int u, int8_t *out) { (void)u; table_levels(blk + 1, KVALUES_MXFP4, out); }

static inline void q5_1_levels(const uint8_t *blk, int u, int8_t *out) {
    (void)u;
    uint32_t qh;
    memcpy(&qh, blk + 4, 4);
    for (int l = 0; l < 16; l++) {
        out[l] = (int8_t)((blk[8 + l] & 0xF) | (((qh >> l) & 1) << 4));
        out[l + 16] = (int8_t)((blk[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
    }
}

#if defined(STRATA_AVX2)
/* ---------------------------------------------------------------- the same levels in registers */

static inline __m128i srl_bytes(__m128i v, int n) { return _mm_srl_epi16(v, _mm_cvtsi32_si128(n)); } /* then mask */
static inline __m128i load16(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
/* 0xFF where v has all the bits of `bit`, else 0 */
static inline __m128i has_bit(__m128i v, __m128i bit) { return _mm_cmpeq_epi8(_mm_and_si128(v, bit), bit); }

static inline void q4_k_levels_x(const uint8_t *blk, int u, __m128i *lo, __m128i *hi) {
    const uint8_t *qs = blk + 16 + 32 * (u / 2);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    *lo = _mm_and_si128(srl_bytes(load16(qs), 4 * (u % 2)), m4);
    *hi = _mm_and_si128(srl_bytes(load16(qs + 16), 4 * (u % 2)), m4);
}

static inline void q5_k_levels_x(const uint8_t *blk, int u, __m128i *lo, __m128i *hi) {
    const uint8_t *qh = blk + 16, *qs = blk + 48 + 32 * (u / 2);
    const __m128i m4 = _mm_set1_epi8(0x0F), bit = _mm_set1_epi8((char)(1 << u)), sixteen = _mm_set1_epi8(16);
    *lo = _mm_or_si128(_mm_and_si128(srl_bytes(load16(qs), 4 * (u % 2)), m4),
                       _mm_and_si128(has_bit(load16(qh), bit), sixteen));
    *hi = _mm_or_si128(_mm_and_si128(srl_bytes(load16(qs + 16), 4 * (u % 2)), m4),
                       _mm_and_si128(has_bit(load16(qh + 16), bit), sixteen));
}

static inline void q6_k_levels_x(const uint8_t *blk, int u, __m128i *lo, __m128i *hi) {
    const int h = u / 4, k = u % 4;
    const uint8_t *ql = blk + 64 * h + 32 * (k % 2), *qh = blk + 128 + 32 * h;
    const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(3), bias = _mm_set1_epi8(32);
    for (int half = 0; half < 2; half++) {
        const __m128i low = _mm_and_si128(srl_bytes(load16(ql + 16 * half), 4 * (k / 2)), m4);
        const __m128i high = _mm_and_si128(srl_bytes(load16(qh + 16 * half), 2 * k), m2);
        const __m128i v = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), bias);
        *(half ? hi : lo) = v;
    }
}

static inline void q3_k_levels_x(const uint8_t *blk, int u, __m128i *lo, __m128i *hi) {
    const int h = u / 4, j = u % 4;
    const uint8_t *qs = blk + 32 + 32 * h;
    const __m128i m2 = _mm_set1_epi8(3), four = _mm_set1_epi8(4), bit = _mm_set1_epi8((char)(1 << u));
    for (int half = 0; half < 2; half++) {
        const __m128i q = _mm_and_si128(srl_bytes(load16(qs + 16 * half), 2 * j), m2);
        const __m128i v = _mm_sub_epi8(q, _mm_andnot_si128(has_bit(load16(blk + 16 * half), bit), four));
        *(half ? hi : lo) = v;
    }
}

static inline void q2_k_levels_x(const uint8_t *blk, int u, __m128i *lo, __m128i *hi) {
    const uint8_t *qs = blk + 16 + 32 * (u / 4);
    const __m128i m2 = _mm_set1_epi8(3);
    *lo = _mm_and_si128(srl_bytes(load16(qs), 2 * (u % 4)), m2);
    *hi = _mm_and_si128(srl_bytes(load16(qs + 16), 2 * (u % 4)), m2);
}

static inline void table_levels_x(const uint8_t *qs, const int8_t *table, __m128i *lo, __m128i *hi) {
    const __m128i t = _mm_loadu_si128((const __m128i *)table), b = load16(qs), m4 = _mm_set1_epi8(0x0F);
    *lo = _mm_shuffle_epi8(t, _mm_and_si128(b, m4));
    *hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(b, 4), m4));
}

static inline void iq4_nl_levels_x(const uint8_t *blk, int u, __m128i *lo, __m128i *hi) {
    (void)u;
    table_levels_x(blk + 2, KVALUES_IQ4NL, lo, hi);
}
static inline void iq4_xs_levels_x(const uint8_t *blk, int u, __m128i *lo, __m128i *hi) {
    table_levels_x(blk + 8 + 16 * u, KVALUES_IQ4NL, lo, hi);
}
static inline void mxfp4_levels_x(const uint8_t *blk, int u, __m128i *lo, __m128i *hi) {
    (void)u;
    table_levels_x(blk + 1, KVALUES_MXFP4, lo, hi);
}

static inline void q5_1_levels_x(const uint8_t *blk, int u, __m128i *lo, __m128i *hi) {
    (void)u;
    /* bit j of the 32-bit qh is weight j's fifth bit: byte j / 8 of qh copied to byte j, then its bit j % 8 */
    int32_t qh;
    memcpy(&qh, blk + 4, 4);
    const __m128i v = _mm_cvtsi32_si128(qh), sixteen = _mm_set1_epi8(16), m4 = _mm_set1_epi8(0x0F);
    const __m128i bits = _mm_set1_epi64x((long long)0x8040201008040201ULL);
    const __m128i spread_lo = _mm_shuffle_epi8(v, _mm_set_epi64x(0x0101010101010101LL, 0));
    const __m128i spread_hi = _mm_shuffle_epi8(v, _mm_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL));
    const __m128i b = load16(blk + 8);
    *lo = _mm_or_si128(_mm_and_si128(b, m4), _mm_and_si128(has_bit(spread_lo, bits), sixteen));
    *hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(has_bit(spread_hi, bits), sixteen));
}

/* one row of whole blocks against up to TILE tokens. SPLIT: the halves have their own scales.
 * OFFSET: the unit's weights are built in float32 first (a * level + o, one multiply-add per 8),
 * then multiplied with x; else the levels multiply x and the sum is scaled once per half. */
#define UNIT_ROW(T, BLOCK_BYTES, UNITS, SPLIT, OFFSET)                                               \
    static inline void T##_row(const uint8_t *c, int64_t n_units, const float *x, int64_t n_cols,   \
                               int nt, float *out) {                                                 \
        __m256 acc[TILE];                                                                            \
        for (int t = 0; t < TILE; t++) acc[t] = _mm256_setzero_ps();                                 \
        for (int64_t b = 0; b < n_units / (UNITS); b++)                                              \
        UNROLL_UNITS for (int u = 0; u < (UNITS); u++) { /* u constant in each copy: shifts, masks */ \
            const uint8_t *blk = c + b * (BLOCK_BYTES);                                              \
            const int64_t k = b * (UNITS) + u;                                                       \
            __m128i lo, hi;                                                                          \
            float a[2], o[2];                                                                        \
            T##_levels_x(blk, u, &lo, &hi);                                                          \
            T##_scales(blk, u, a, o);                                                                \
            __m256 w0 = widen8(lo), w1 = widen8(_mm_srli_si128(lo, 8));                              \
            __m256 w2 = widen8(hi), w3 = widen8(_mm_srli_si128(hi, 8));                              \
            const __m256 a0 = _mm256_set1_ps(a[0]), a1 = _mm256_set1_ps(a[1]);                       \
            if (OFFSET) {                                                                            \
                const __m256 o0 = _mm256_set1_ps(o[0]), o1 = _mm256_set1_ps(o[1]);                   \
                w0 = _mm256_fmadd_ps(a0, w0, o0);                                                    \
                w1 = _mm256_fmadd_ps(a0, w1, o0);                                                    \
                w2 = _mm256_fmadd_ps(a1, w2, o1);                                                    \
                w3 = _mm256_fmadd_ps(a1, w3, o1);                                                    \
            }                                                                                        \
            for (int t = 0; t < nt; t++) {                                                           \
                const float *xb = x + t * n_cols + k * BLOCK;                                        \
                __m256 p = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));                                   \
                p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), p);                                 \
                if (OFFSET) {                                                                        \
                    p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), p);                            \
                    p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), p);                            \
                    acc[t] = _mm256_add_ps(acc[t], p);                                               \
                } else if (SPLIT) {                                                                  \
                    __m256 q = _mm256_mul_ps(w2, _mm256_loadu_ps(xb + 16));                          \
                    q = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), q);                            \
                    acc[t] = _mm256_fmadd_ps(a1, q, _mm256_fmadd_ps(a0, p, acc[t]));                 \
                } else {                                                                             \
                    p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), p);                            \
                    p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), p);                            \
                    acc[t] = _mm256_fmadd_ps(a0, p, acc[t]);                                         \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int t = 0; t < nt; t++) {                                                               \
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1)); \
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                                  \
            s = _mm_add_ss(s, _mm_movehdup_ps(s));                                                   \
            out[t] = _mm_cvtss_f32(s);                                                               \
        }                                                                                            \
    }
#else
#define UNIT_ROW(T, BLOCK_BYTES, UNITS, SPLIT, OFFSET)                                               \
    static inline void T##_row(const uint8_t *c, int64_t n_units, const float *x, int64_t n_cols,   \
                               int nt, float *out) {                                                 \
        float acc[TILE][LANES] = {{0}}, w[BLOCK];                                                    \
        int8_t lv[BLOCK];                                                                            \
        for (int64_t b = 0; b < n_units / (UNITS); b++)                                              \
        UNROLL_UNITS for (int u = 0; u < (UNITS); u++) { /* u constant in each copy: shifts, masks */ \
            const uint8_t *blk = c + b * (BLOCK_BYTES);                                              \
            const int64_t k = b * (UNITS) + u;                                                       \
            float a[2], o[2];                                                                        \
            T##_levels(blk, u, lv);                                                                  \
            T##_scales(blk, u, a, o);                                                                \
            for (int j = 0; j < BLOCK; j++) w[j] = a[j / LANES] * (float)lv[j] + o[j / LANES];       \
            for (int t = 0; t < nt; t++) {                                                           \
                const float *xb = x + t * n_cols + k * BLOCK;                                        \
                for (int j = 0; j < LANES; j++) acc[t][j] += w[j] * xb[j] + w[j + LANES] * xb[j + LANES]; \
            }                                                                                        \
        }                                                                                            \
        for (int t = 0; t < nt; t++) {                                                               \
            for (int v = LANES / 2; v; v /= 2)                                                       \
                for (int j = 0; j < v; j++) acc[t][j] += acc[t][j + v];                              \
            out[t] = acc[t][0];                                                                      \
        }                                                                                            \
    }
#endif

/* the entry point of one block type: the same arguments as the 32-weight types' (scales unused:
 * a row's scales are inside its blocks) */
#define DEFINE_UNIT_GEMV(T, BLOCK_BYTES, UNITS, SPLIT, OFFSET)                                       \
    UNIT_ROW(T, BLOCK_BYTES, UNITS, SPLIT, OFFSET)                                                   \
    void strata_##T##_gemv(const uint8_t *codes, const uint16_t *scales, int64_t n_rows, int64_t n_cols, \
                           const float *x, int64_t n_tokens, float *y, int64_t r0, int64_t r1) {     \
        (void)scales;                                                                                \
        const int64_t n_units = n_cols / BLOCK, row_bytes = n_units / (UNITS) * (BLOCK_BYTES);       \
        float out[TILE];                                                                             \
        for (int64_t r = r0; r < r1; r++)                                                            \
            for (int64_t t0 = 0; t0 < n_tokens; t0 += TILE) {                                        \
                const int nt = n_tokens - t0 < TILE ? (int)(n_tokens - t0) : TILE;                   \
                T##_row(codes + r * row_bytes, n_units, x + t0 * n_cols, n_cols, nt, out);          \
                for (int t = 0; t < nt; t++) y[(t0 + t) * n_rows + r] = out[t];                      \
            }                                                                                        \
    }

/*               type    block bytes  units  split  offset */
DEFINE_UNIT_GEMV(q4_k,   144,         8,     0,     1)
DEFINE_UNIT_GEMV(q5_k,   176,         8,     0,     1)
DEFINE_UNIT_GEMV(q6_k,   210,         8,     1,     0)
DEFINE_UNIT_GEMV(q3_k,   110,         8,     1,     0)
DEFINE_UNIT_GEMV(q2_k,   84,          8,     1,     1)
DEFINE_UNIT_GEMV(iq4_nl, 18,          1,     0,     0)
DEFINE_UNIT_GEMV(iq4_xs, 136,         8,     0,     0)
DEFINE_UNIT_GEMV(mxfp4,  17,          1,     0,     0)
DEFINE_UNIT_GEMV(q5_1,   24,          1,     0,     1)

/* ---------------------------------------------------------------- one token's experts */

typedef void (*gemv_fn)(const uint8_t *, const uint16_t *, int64_t, int64_t, const float *, int64_t, float *,
                        int64_t, int64_t);

/* out[i] = down_i(silu(gate_i x) * (up_i x)) for experts i < n_experts (SwiGLU, no biases), one
 * token: gate_i, up_i [ffn, hidden] and down_i [hidden, ffn] given by their planes' addresses, each
 * projection computed by its type's GEMV above (gate, up and down may differ in type: a llama.cpp
 * file's Q4_K gate and up with a Q5_1 down). silu(g) * u is computed as the reference writes it:
 * g / (1 + exp(-g)), then times u. scratch: 2 ffn floats. out: [n_experts, hidden]. One call per
 * layer instead of three per expert: the per-call overhead of Python is what a decode token's many
 * small products add up to. */
void strata_swiglu(gemv_fn gate, gemv_fn up, gemv_fn down, int64_t n_experts, const uint8_t *const *gate_codes,
                   const uint16_t *const *gate_scales, const uint8_t *const *up_codes,
                   const uint16_t *const *up_scales, const uint8_t *const *down_codes,
                   const uint16_t *const *down_scales, int64_t hidden, int64_t ffn, const float *x, float *out,
                   float *scratch) {
    float *g = scratch, *u = scratch + ffn;
    for (int64_t i = 0; i < n_experts; i++) {
        gate(gate_codes[i], gate_scales[i], ffn, hidden, x, 1, g, 0, ffn);
        up(up_codes[i], up_scales[i], ffn, hidden, x, 1, u, 0, ffn);
        for (int64_t j = 0; j < ffn; j++) g[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
        down(down_codes[i], down_scales[i], hidden, ffn, g, 1, out + i * hidden, 0, hidden);
    }
}

/* ---------------------------------------------------------------- workers (one call, several threads) */

/* A product split over threads inside one call: the work is cut into chunks (an expert, or a
 * range of rows) that the caller and the library's workers claim one at a time. Why not Python's
 * thread pool: waking a sleeping thread (a futex; on a VM an interrupt to an idle virtual core)
 * took ~0.4-0.5 ms here, a fifth of a decode layer's experts (2.3 ms), so two threads gained
 * nothing in decode. A worker here spins for SPIN_NS after its last chunk (the next product
 * usually comes sooner), then sleeps. Why chunks claimed, not a fixed share per thread: on a
 * shared machine a worker may be descheduled; the caller then computes the chunks it has not
 * claimed instead of waiting for it (a fixed split waited a scheduler slice per product: 2
 * threads fell to a third of one thread's speed under one competing process). Each chunk runs
 * the one-thread code on its rows or experts, so results equal one thread's bit for bit. One
 * dispatch at a time (a mutex); workers start at first use. */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 63
#define SPIN_NS 2000000 /* 2 ms: a decode step's Python between two products is ~0.1-1 ms */
#define GEMV_CHUNK_ROWS 64

typedef void (*chunk_fn)(const void *job, int64_t chunk, int64_t slot); /* slot: the thread's, < parts */

static struct {
    pthread_mutex_t dispatch, sleep;
    pthread_cond_t wake;
    _Atomic uint64_t work;   /* dispatch number << 32 | next unclaimed chunk */
    atomic_llong finished;   /* chunks of the current dispatch done */
    int started;             /* workers running */
    pid_t pid;               /* the process that started them (a forked child has none) */
    uint32_t start_gen;      /* dispatch number when the newest workers were started */
    chunk_fn fn;             /* the current dispatch (read by workers only with a claim on it) */
    const void *job;
    int64_t n_chunks, parts;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline uint32_t dispatch_of(uint64_t work) { return (uint32_t)(work >> 32); }

/* claim and run chunks of dispatch `gen` until none is left. A claim succeeds only while `gen` is
 * current with chunks unclaimed, and the caller does not return before every claimed chunk is done,
 * so fn and job read before a successful claim are that dispatch's. */
static void run_chunks(uint32_t gen, int64_t slot) {
    uint64_t v = atomic_load_explicit(&pool.work, memory_order_acquire);
    for (;;) {
        if (dispatch_of(v) != gen) return;
        const chunk_fn fn = __atomic_load_n(&pool.fn, __ATOMIC_RELAXED);
        const void *job = __atomic_load_n(&pool.job, __ATOMIC_RELAXED);
        const int64_t n = __atomic_load_n(&pool.n_chunks, __ATOMIC_RELAXED);
        const int64_t c = (int64_t)(v & 0xffffffffu);
        if (c >= n || slot >= __atomic_load_n(&pool.parts, __ATOMIC_RELAXED)) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.work, &v, v + 1, memory_order_acq_rel, memory_order_acquire))
            continue; /* v reloaded */
        fn(job, c, slot);
        atomic_fetch_add_explicit(&pool.finished, 1, memory_order_release);
        v = atomic_load_explicit(&pool.work, memory_order_acquire);
    }
}

static void *worker_main(void *arg) {
    const int64_t slot = (int64_t)(intptr_t)arg; /* 1.. */
    uint32_t seen = __atomic_load_n(&pool.start_gen, __ATOMIC_ACQUIRE);
    for (;;) {
        const int64_t spin_from = now_ns();
        for (int i = 0; dispatch_of(atomic_load_explicit(&pool.work, memory_order_acquire)) == seen; i++) {
            cpu_relax();
            if ((i & 255) == 255 && now_ns() - spin_from > SPIN_NS) {
                pthread_mutex_lock(&pool.sleep);
                while (dispatch_of(atomic_load(&pool.work)) == seen) pthread_cond_wait(&pool.wake, &pool.sleep);
                pthread_mutex_unlock(&pool.sleep);
            }
        }
        seen = dispatch_of(atomic_load_explicit(&pool.work, memory_order_acquire));
        run_chunks(seen, slot);
    }
    return NULL;
}

/* fn(job, c, slot) for every chunk c < n_chunks, over this thread (slot 0) and up to parts - 1
 * workers (slots 1..); returns when all are done */
static void run_parts(chunk_fn fn, const void *job, int64_t n_chunks, int64_t parts) {
    if (parts > MAX_WORKERS + 1) parts = MAX_WORKERS + 1;
    if (pool.pid != getpid()) { /* first use, or a child forked from a process with workers */
        pthread_mutex_init(&pool.dispatch, NULL), pthread_mutex_init(&pool.sleep, NULL);
        pthread_cond_init(&pool.wake, NULL);
        pool.started = 0, pool.pid = getpid();
    }
    pthread_mutex_lock(&pool.dispatch);
    const uint32_t gen = dispatch_of(atomic_load(&pool.work)) + 1;
    __atomic_store_n(&pool.start_gen, gen - 1, __ATOMIC_RELEASE);
    while (pool.started < parts - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker_main, (void *)(intptr_t)(pool.started + 1)) != 0) break;
        pthread_detach(t);
        pool.started++;
    }
    __atomic_store_n(&pool.fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job, job, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.n_chunks, n_chunks, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.parts, parts, __ATOMIC_RELAXED);
    atomic_store(&pool.finished, 0);
    pthread_mutex_lock(&pool.sleep);
    atomic_store_explicit(&pool.work, (uint64_t)gen << 32, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep);
    run_chunks(gen, 0);
    while (atomic_load_explicit(&pool.finished, memory_order_acquire) < n_chunks) cpu_relax();
    pthread_mutex_unlock(&pool.dispatch);
}

struct gemv_job {
    gemv_fn fn;
    const uint8_t *codes;
    const uint16_t *scales;
    int64_t n_rows, n_cols, n_tokens;
    const float *x;
    float *y;
};

static void gemv_chunk(const void *p, int64_t chunk, int64_t slot) {
    const struct gemv_job *j = p;
    (void)slot;
    const int64_t r0 = chunk * GEMV_CHUNK_ROWS, r1 = r0 + GEMV_CHUNK_ROWS < j->n_rows ? r0 + GEMV_CHUNK_ROWS : j->n_rows;
    j->fn(j->codes, j->scales, j->n_rows, j->n_cols, j->x, j->n_tokens, j->y, r0, r1);
}

/* fn (a GEMV above) on all rows, in chunks of GEMV_CHUNK_ROWS over up to `threads` threads */
void strata_gemv_threads(gemv_fn fn, const uint8_t *codes, const uint16_t *scales, int64_t n_rows, int64_t n_cols,
                         const float *x, int64_t n_tokens, float *y, int64_t threads) {
    const struct gemv_job j = {fn, codes, scales, n_rows, n_cols, n_tokens, x, y};
    run_parts(gemv_chunk, &j, (n_rows + GEMV_CHUNK_ROWS - 1) / GEMV_CHUNK_ROWS, threads);
}

struct swiglu_job {
    gemv_fn gate, up, down;
    const uint8_t *const *gate_codes, *const *up_codes, *const *down_codes;
    const uint16_t *const *gate_scales, *const *up_scales, *const *down_scales;
    int64_t hidden, ffn;
    const float *x;
    float *out, *scratch;
};

static void swiglu_chunk(const void *p, int64_t e, int64_t slot) {
    const struct swiglu_job *j = p;
    strata_swiglu(j->gate, j->up, j->down, 1, j->gate_codes + e, j->gate_scales + e, j->up_codes + e,
                  j->up_scales + e, j->down_codes + e, j->down_scales + e, j->hidden, j->ffn, j->x,
                  j->out + e * j->hidden, j->scratch + slot * 2 * j->ffn);
}

/* strata_swiglu with each expert a chunk, over up to `threads` threads; scratch: 2 ffn floats per thread */
void strata_swiglu_threads(gemv_fn gate, gemv_fn up, gemv_fn down, int64_t n_experts,
                           const uint8_t *const *gate_codes, const uint16_t *const *gate_scales,
                           const uint8_t *const *up_codes, const uint16_t *const *up_scales,
                           const uint8_t *const *down_codes, const uint16_t *const *down_scales, int64_t hidden,
                           int64_t ffn, const float *x, float *out, float *scratch, int64_t threads) {
    if (threads <= 1) { /* no dispatch */
        strata_swiglu(gate, up, down, n_experts, gate_codes, gate_scales, up_codes, up_scales, down_codes,
                      down_scales, hidden, ffn, x, out, scratch);
        return;
    }
    const struct swiglu_job j = {gate, up, down, gate_codes, up_codes, down_codes, gate_scales, up_scales,
                                 down_scales, hidden, ffn, x, out, scratch};
    run_parts(swiglu_chunk, &j, n_experts, threads < n_experts ? threads : n_experts);
}
