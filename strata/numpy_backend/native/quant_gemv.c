/* Quantized GEMV on the CPU: y[t] = W x[t] with W in Q8_0, Q4_0 or Q2_0 as strata stores it (two
 * planes: the codes, then one float16 scale d per block of 32 weights), x and y float32.
 *
 * x stays float32 (no activation quantization, unlike ggml's q8_0 x q8_0 dot): each block's 32
 * products are summed in float32 and times the block's scale d; so against the reference (widen W
 * to float32, then a float32 matrix product) only the summation order differs.
 *
 * A block's signed levels (q for Q8_0, q - 8 for Q4_0, q - 2 for Q2_0) are unpacked to 32 int8,
 * then widened and multiplied with x in float32: AVX2 + FMA intrinsics where the build machine
 * has them (the levels unpacked in registers; 8 lanes, 4 multiply-adds per block; the row keeps
 * one 8-lane sum, reduced once at its end), a portable loop the compiler vectorizes elsewhere
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

/* ---------------------------------------------------------------- one token's experts */

/* out[i] = down_i(silu(gate_i x) * (up_i x)) for experts i < n_experts (SwiGLU, no biases), one
 * token: gate_i, up_i [ffn, hidden] and down_i [hidden, ffn] given by their planes' addresses.
 * silu(g) * u is computed as the reference writes it: g / (1 + exp(-g)), then times u.
 * scratch: 2 ffn floats. out: [n_experts, hidden]. One call per layer instead of three per expert:
 * the per-call overhead of Python is what a decode token's many small products add up to. */
#define DEFINE_SWIGLU(NAME, GEMV)                                                                    \
    void NAME(int64_t n_experts, const uint8_t *const *gate_codes, const uint16_t *const *gate_scales, \
              const uint8_t *const *up_codes, const uint16_t *const *up_scales,                     \
              const uint8_t *const *down_codes, const uint16_t *const *down_scales, int64_t hidden,  \
              int64_t ffn, const float *x, float *out, float *scratch) {                             \
        float *g = scratch, *u = scratch + ffn;                                                      \
        for (int64_t i = 0; i < n_experts; i++) {                                                    \
            GEMV(gate_codes[i], gate_scales[i], ffn, hidden, x, 1, g, 0, ffn);                       \
            GEMV(up_codes[i], up_scales[i], ffn, hidden, x, 1, u, 0, ffn);                           \
            for (int64_t j = 0; j < ffn; j++) g[j] = g[j] / (1.0f + expf(-g[j])) * u[j];             \
            GEMV(down_codes[i], down_scales[i], hidden, ffn, g, 1, out + i * hidden, 0, hidden);     \
        }                                                                                            \
    }

DEFINE_SWIGLU(strata_q8_0_swiglu, strata_q8_0_gemv)
DEFINE_SWIGLU(strata_q4_0_swiglu, strata_q4_0_gemv)
DEFINE_SWIGLU(strata_q2_0_swiglu, strata_q2_0_gemv)
