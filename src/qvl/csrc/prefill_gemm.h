/* What the two prefill GEMMs (prefill_gemm.c's 16-bit pair kernel, byte_gemm.c's byte-code
 * kernel) share: the vector width and row blocks per tier, the threads' work sharing, rows as
 * float32, the rescaled output rows, and on x86 the weight panels and named register rows. */
#ifndef QVL_PREFILL_GEMM_H
#define QVL_PREFILL_GEMM_H
#include "common.h"

#if defined(QVL_AVX512) || defined(QVL_AVX2) || (defined(QVL_NEON) && defined(__ARM_FEATURE_DOTPROD))

#define I16_KC 256 /* inputs per int32 block */
#ifndef ROW_CHUNK
#define ROW_CHUNK (2 << 20) /* bytes of activation codes per chunk of row blocks (2-4 MB measured best) */
#endif

#ifdef QVL_AVX512
#define VL 16
#define I16_MR 10
typedef __m512i vint;
typedef __m512 vflt;
#define vi_load(p) _mm512_load_si512((const void*)(p))
#define vi_set1(v) _mm512_set1_epi32(v)
#define vi_zero() _mm512_setzero_si512()
#define vf_of(i) _mm512_cvtepi32_ps(i)
#define vf_load(p) _mm512_loadu_ps(p)
#define vf_store(p, v) _mm512_storeu_ps(p, v)
#define vf_add(a, b) _mm512_add_ps(a, b)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_fmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_set1(v) _mm512_set1_ps(v)
#elif defined(QVL_AVX2)
#define VL 8
#define I16_MR 6
typedef __m256i vint;
typedef __m256 vflt;
#define vi_load(p) _mm256_load_si256((const __m256i*)(p))
#define vi_set1(v) _mm256_set1_epi32(v)
#define vi_zero() _mm256_setzero_si256()
#define vf_of(i) _mm256_cvtepi32_ps(i)
#define vf_load(p) _mm256_loadu_ps(p)
#define vf_store(p, v) _mm256_storeu_ps(p, v)
#define vf_add(a, b) _mm256_add_ps(a, b)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_fmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_set1(v) _mm256_set1_ps(v)
#else /* NEON with dot products: the byte kernel only */
#define VL 4
typedef float32x4_t vflt;
#define vf_load(p) vld1q_f32(p)
#define vf_store(p, v) vst1q_f32(p, v)
#define vf_add(a, b) vaddq_f32(a, b)
#define vf_mul(a, b) vmulq_f32(a, b)
#define vf_fmadd(a, b, c) vfmaq_f32(c, a, b)
#define vf_set1(v) vdupq_n_f32(v)
#endif
#define I16_NR (2 * VL) /* output columns per register block: two vectors */

/* The next of `items` pieces of work shared by the threads (*next counts the attempts), or -1
 * when none is left: the threads take (chunk of row blocks, column tile) pairs in turn as they
 * finish the last, so a slower core (an E-core beside P-cores, a busy vCPU) takes fewer instead
 * of keeping the others waiting; a tile's result does not depend on which thread computes it. */
static inline int64_t take_item(int64_t* next, int64_t items) {
    int64_t item;
#pragma omp atomic capture
    item = (*next)++;
    return item < items ? item : -1;
}

/* Row blocks per chunk: as many as ROW_CHUNK bytes of their codes hold (block_bytes each), at least one. */
static inline int64_t chunk_blocks(int64_t block_bytes) {
    return ROW_CHUNK / block_bytes > 1 ? ROW_CHUNK / block_bytes : 1;
}

/* Row m of x (dt [M][K]) as float32 (bf16 widened into buf); *finite: no NaN or infinity in it. */
static inline const float* row_f32(const void* x, int dt, int64_t K, int64_t m, float* buf, int* finite) {
    const float* row = (const float*)x + m * K;
    if (dt == BF16) {
        const uint16_t* h = (const uint16_t*)x + m * K;
#pragma omp simd
        for (int64_t k = 0; k < K; k++) buf[k] = bf16_to_f32(h[k]);
        row = buf;
    }
    *finite = all_finite(row, K);
    return row;
}

/* y[m][n0 + j] = c[m][j] * cs[j] * s[m] + cb[j] for m < M, j < nc (nc <= I16_NR); s NULL: 1;
 * cs, cb: the columns' scales and biases in float32 (from qvl_rescale_columns, at n0).
 * Then tanh-GELU when `gelu` (before the one rounding to dt), then, when `res` is given ([M][N],
 * dt), res + that rounded value, rounded again: as a separate GELU in float32 and `res + y`
 * would (int8_passes.c's rescale does the same). */
static inline void write_rows(const float* c, int64_t ldc, const float* s, int64_t M, int64_t n0, int64_t nc,
                       const float* cs, const float* cb, int dt, int64_t N, int gelu, const void* res, void* y) {
    float out[I16_NR];
    for (int64_t m = 0; m < M; m++) {
        float* dst = dt == F32 ? (float*)y + m * N + n0 : out;
        const vflt sm = vf_set1(s ? s[m] : 1.f);
        for (int64_t j = 0; j < nc; j += VL)
            vf_store(dst + j, vf_fmadd(vf_mul(vf_load(c + m * ldc + j), vf_load(cs + j)), sm, vf_load(cb + j)));
        if (gelu) qvl_gelu_tanh(dst, nc);
        if (dt != BF16) {
            const float* rf = res ? (const float*)res + m * N + n0 : NULL;
            if (rf)
                for (int64_t j = 0; j < nc; j += VL) vf_store(dst + j, vf_add(vf_load(dst + j), vf_load(rf + j)));
            continue;
        }
        uint16_t* yb = (uint16_t*)y + m * N + n0;
        const uint16_t* rb = res ? (const uint16_t*)res + m * N + n0 : NULL;
        int64_t j = 0;
#if defined(QVL_AVX512) && defined(__AVX512BF16__)
        for (; j < nc; j += 16) store16_bf16(_mm512_loadu_ps(out + j), rb ? rb + j : NULL, yb + j);
#endif
        for (; j < nc; j++) yb[j] = f32_to_bf16(rb ? round_bf(out[j]) + bf16_to_f32(rb[j]) : out[j]);
    }
}


#if defined(QVL_AVX512) || defined(QVL_AVX2)
#ifdef QVL_AVX512
#define WIDEN_ROWS 16 /* weight rows and input pairs per transposed block */
typedef __m512 vblock;
static inline vblock widen16(const int8_t* p) { /* 32 int8 -> 16 dwords of two int16 */
    return _mm512_castsi512_ps(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)));
}
static inline vblock quads(const int8_t* p) { /* 64 int8 -> 16 dwords of 4 bytes + 128 */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_loadu_si512((const void*)p), _mm512_set1_epi8(-128)));
}
static inline vblock nibble_quads(const int8_t* p) { /* 32 bytes of nibbles -> 16 dwords of 4 bytes 0..15 */
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)); /* byte b -> word b */
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi16(0x0F)),
                                               _mm512_and_si512(_mm512_slli_epi16(v, 4), _mm512_set1_epi16(0x0F00))));
}
#define transpose_block transpose16
#define vblock_store(p, v) _mm512_store_ps((float*)(p), v)
#else
#define WIDEN_ROWS 8
typedef __m256 vblock;
static inline vblock widen16(const int8_t* p) { /* 16 int8 -> 8 dwords of two int16 */
    return _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)));
}
static inline vblock quads(const int8_t* p) { /* 32 int8 -> 8 dwords of 4 bytes + 128 */
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_loadu_si256((const __m256i*)p), _mm256_set1_epi8(-128)));
}
static inline vblock nibble_quads(const int8_t* p) { /* 16 bytes of nibbles -> 8 dwords of 4 bytes 0..15 */
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)); /* byte b -> word b */
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(0x0F)),
                                               _mm256_and_si256(_mm256_slli_epi16(v, 4), _mm256_set1_epi16(0x0F00))));
}
static inline void transpose_block(__m256 r[8]) { /* r[i] row i of 8 x 8 -> r[j] column j */
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        const __m256d a = _mm256_castps_pd(t[4 * i]), b = _mm256_castps_pd(t[4 * i + 2]);
        const __m256d c = _mm256_castps_pd(t[4 * i + 1]), d = _mm256_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, b));
        u[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, b));
        u[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(c, d));
        u[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(c, d));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}
#define vblock_store(p, v) _mm256_store_ps((float*)(p), v)
#endif

/* The panels' forms: each dword two int8 inputs sign-extended to int16 (the pair kernel's), four
 * int8 inputs as bytes + 128 (the byte kernel's unsigned operand), or four int4 inputs (two
 * bytes of nibbles, the even input in the low one) as bytes 0..15 (the same operand). */
enum { PANEL_PAIRS, PANEL_BYTES, PANEL_NIBBLES };

/* w rows n0..n0+nr-1 (nr <= I16_NR, a multiple of VL; int8 [N][K], or nibbles [N][K/2]),
 * inputs k0..k0+kc-1 (k0 and kc multiples of the form's inputs per dword) -> b[kc/unit][I16_NR]
 * dwords in `form` (lanes past nr zero): WIDEN_ROWS rows x WIDEN_ROWS dwords at a time,
 * transposed in registers. */
static inline __attribute__((always_inline)) void weight_panel(const int8_t* w, int64_t K, int64_t n0, int64_t nr,
                                                                int64_t k0, int64_t kc, const int form, int32_t* b) {
    const int unit = form == PANEL_PAIRS ? 2 : 4, bytes = form == PANEL_NIBBLES ? 2 : unit; /* per dword */
    const int64_t ld = form == PANEL_NIBBLES ? K / 2 : K; /* bytes per weight row */
    const int64_t units = kc / unit, whole = units / WIDEN_ROWS * WIDEN_ROWS;
    for (int64_t c0 = 0; c0 < I16_NR; c0 += WIDEN_ROWS) {
        if (c0 >= nr) {
            for (int64_t p = 0; p < units; p++) memset(b + p * I16_NR + c0, 0, WIDEN_ROWS * 4);
            continue;
        }
        const int8_t* wr = w + (n0 + c0) * ld + k0 / unit * bytes;
        for (int64_t p0 = 0; p0 < whole; p0 += WIDEN_ROWS) {
            vblock v[WIDEN_ROWS];
            for (int i = 0; i < WIDEN_ROWS; i++) {
                const int8_t* q = wr + i * ld + bytes * p0;
                v[i] = form == PANEL_PAIRS ? widen16(q) : form == PANEL_BYTES ? quads(q) : nibble_quads(q);
            }
            transpose_block(v);
            for (int i = 0; i < WIDEN_ROWS; i++) vblock_store(b + (p0 + i) * I16_NR + c0, v[i]);
        }
        for (int64_t p = whole; p < units; p++)
            for (int i = 0; i < WIDEN_ROWS; i++) {
                const int8_t* q = wr + i * ld + bytes * p;
                uint32_t d = 0;
                for (int j = 0; j < unit; j++)
                    d |= form == PANEL_PAIRS ? (uint32_t)(uint16_t)(int16_t)q[j] << (16 * j)
                         : form == PANEL_BYTES ? (uint32_t)(uint8_t)(q[j] + 128) << (8 * j)
                                               : (uint32_t)(((uint8_t)q[j / 2] >> (4 * (j % 2))) & 15) << (8 * j);
                b[p * I16_NR + c0 + i] = (int32_t)d;
            }
    }
}

/* The register block: I16_MR rows of named accumulators (an array of them the compiler kept
 * in memory between iterations), c for the first vector of columns, d for the second. */
#define I16_ROWS_6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define I16_ROWS_10(X) I16_ROWS_6(X) X(6) X(7) X(8) X(9)
#define I16_ROWS_(n) I16_ROWS_##n
#define I16_ROWS_N(n) I16_ROWS_(n)
#define I16_ROWS I16_ROWS_N(I16_MR) /* X(0) ... X(I16_MR - 1) */
#endif
#endif
#endif
