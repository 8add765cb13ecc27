/* Many-row products with int8 weights where the CPU has no AMX (prefill on AVX-512 and AVX2):
 * y = x . (w * scale)^T (+ bias), the activations in 16-bit codes per row (qvl_i16_linear), or
 * with VNNI in 8-bit codes per group of columns (qvl_q8_linear, further down; on ARM with dot
 * products too, where it is the only one of the two).
 *
 * Each row of x is quantised symmetrically to int16 codes (step max|row| / 32767: about bf16's
 * relative precision on the row's large values, finer than bf16 on its small ones, and
 * independent of the other rows). Codes and weights are multiplied in 16-bit pairs with exact
 * int32 sums (vpdpwssd with AVX-512 VNNI or AVX-VNNI; vpmaddwd + vpaddd elsewhere), which these
 * CPUs retire at about twice the rate of float32 FMAs, and no dequantised copy of the weight is
 * made. The int32 sums cover I16_KC columns at a time (|sum| <= 256 * 32767 * 128 < 2^31) and
 * are added in float32 in a fixed order, so a row's result depends neither on the other rows
 * nor on the number of threads.
 *
 * Blocking: the threads take (chunk of row blocks, column tile of I16_NR columns) pairs in
 * turn (take_item); a tile covers the whole of K, its weights widened once into 16-bit pairs
 * ([NR lanes] per input pair, L2), and every block of I16_MR activation rows of the chunk
 * (ROW_CHUNK bytes of codes) runs over them with I16_MR x 2 vector accumulators in registers;
 * the tile's float totals stay in L1. A panel of 256 columns with every row's float totals in
 * memory (what it did before) was 1 MB per thread at 1008 rows, past L2
 * (docs/decisions/prefill-products.md). */
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
static const float* row_f32(const void* x, int dt, int64_t K, int64_t m, float* buf, int* finite) {
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
static void write_rows(const float* c, int64_t ldc, const float* s, int64_t M, int64_t n0, int64_t nc,
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
#define QVL_I16 1

/* acc += the sums of a . b's 16-bit pairs per 32-bit lane, in asm: with the intrinsics GCC
 * copied every accumulator to another register (and some to the stack) around each product,
 * which cost a third of the kernel's time (vpdpwssd) or half of it (vpmaddwd + vpaddd). */
#if defined(__AVX512VNNI__) && defined(QVL_AVX512)
static inline vint vi_dp(vint acc, vint a, vint b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}
#elif defined(__AVXVNNI__) && defined(QVL_AVX2)
static inline vint vi_dp(vint acc, vint a, vint b) {
    __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
    return acc;
}
#else
static inline vint vi_dp(vint acc, vint a, vint b) {
    vint t;
    __asm__("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+v"(acc), "=&v"(t) : "v"(a), "v"(b));
    return acc;
}
#endif

/* Rows m0..m0+I16_MR-1 of x (dt [M][K]; rows past M zero) -> codes as int16 pairs
 * a[K/2][I16_MR] (pair p of row r at a[p * I16_MR + r]) and each row's step s[r]. */
static void pack_rows(const void* x, int dt, int64_t M, int64_t K, int64_t m0, int32_t* a, float* s, float* buf,
                      int16_t* codes) {
    for (int r = 0; r < I16_MR; r++) {
        const float* row = buf;
        int finite = 1;
        float top = 0.f;
        if (m0 + r < M) {
            row = row_f32(x, dt, K, m0 + r, buf, &finite);
            top = absmax(row, K);
        }
        const float inv = top > 0.f ? 32767.f / top : 0.f;
        /* rows past M, zero rows and rows too small for 32767 / top to be finite (max < 1e-34)
         * give the bias; a row with NaN or infinity gives NaN; their codes stay 0 */
        const int coded = finite && top > 0.f && inv <= FLT_MAX;
        s[r] = !finite ? NAN : coded ? top / 32767.f : 0.f;
        if (!coded) {
            for (int64_t p = 0; p < K / 2; p++) a[p * I16_MR + r] = 0;
            continue;
        }
#pragma omp simd
        for (int64_t k = 0; k < K; k++) codes[k] = (int16_t)round_int(row[k] * inv); /* |code| <= 32767 */
        for (int64_t p = 0; p < K / 2; p++) memcpy(a + p * I16_MR + r, codes + 2 * p, 4); /* one pair */
    }
}

#ifdef QVL_AVX512
#define WIDEN_ROWS 16 /* weight rows and input pairs per transposed block */
typedef __m512 vblock;
static inline vblock widen16(const int8_t* p) { /* 32 int8 -> 16 dwords of two int16 */
    return _mm512_castsi512_ps(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)));
}
static inline vblock quads(const int8_t* p) { /* 64 int8 -> 16 dwords of 4 bytes + 128 */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_loadu_si512((const void*)p), _mm512_set1_epi8(-128)));
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

/* w rows n0..n0+nr-1 (nr <= I16_NR, a multiple of VL), inputs k0..k0+kc-1 (kc % unit == 0) ->
 * b[kc/unit][I16_NR] dwords (lanes past nr zero), each either two inputs sign-extended to int16
 * (unit 2: the pair kernel's) or four as bytes + 128 (unit 4: the byte kernel's unsigned
 * operand): WIDEN_ROWS rows x WIDEN_ROWS dwords at a time, transposed in registers. */
static inline __attribute__((always_inline)) void weight_panel(const int8_t* w, int64_t K, int64_t n0, int64_t nr,
                                                                int64_t k0, int64_t kc, const int unit, int32_t* b) {
    const int64_t units = kc / unit, whole = units / WIDEN_ROWS * WIDEN_ROWS;
    for (int64_t c0 = 0; c0 < I16_NR; c0 += WIDEN_ROWS) {
        if (c0 >= nr) {
            for (int64_t p = 0; p < units; p++) memset(b + p * I16_NR + c0, 0, WIDEN_ROWS * 4);
            continue;
        }
        const int8_t* wr = w + (n0 + c0) * K + k0;
        for (int64_t p0 = 0; p0 < whole; p0 += WIDEN_ROWS) {
            vblock v[WIDEN_ROWS];
            for (int i = 0; i < WIDEN_ROWS; i++) v[i] = unit == 4 ? quads(wr + i * K + 4 * p0) : widen16(wr + i * K + 2 * p0);
            transpose_block(v);
            for (int i = 0; i < WIDEN_ROWS; i++) vblock_store(b + (p0 + i) * I16_NR + c0, v[i]);
        }
        for (int64_t p = whole; p < units; p++)
            for (int i = 0; i < WIDEN_ROWS; i++) {
                const int8_t* q = wr + i * K + unit * p;
                uint32_t d = 0;
                for (int j = 0; j < unit; j++)
                    d |= unit == 4 ? (uint32_t)(uint8_t)(q[j] + 128) << (8 * j) : (uint32_t)(uint16_t)(int16_t)q[j] << (16 * j);
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
#define ZERO2(r) vint c##r = vi_zero(), d##r = vi_zero();
#define ZERO1(r) vint c##r = vi_zero();
#define STEP2(r)                                         \
    {                                                    \
        const vint av = vi_set1(a[p * I16_MR + (r)]);    \
        c##r = vi_dp(c##r, av, b0), d##r = vi_dp(d##r, av, b1); \
    }
#define STEP1(r) c##r = vi_dp(c##r, vi_set1(a[p * I16_MR + (r)]), b0);
#define FLUSH(acc, r, off)                                                                   \
    {                                                                                        \
        float* cp = c + (r) * ldc + (off);                                                   \
        vf_store(cp, first ? vf_of(acc) : vf_add(vf_load(cp), vf_of(acc)));                  \
    }
#define FLUSH2(r) FLUSH(c##r, r, 0) FLUSH(d##r, r, VL)
#define FLUSH1(r) FLUSH(c##r, r, 0)

/* c[r][0 .. 2 VL) (+)= the exact sums of a [pairs][I16_MR] . b [pairs][I16_NR]; c rows ldc
 * floats apart; `first`: store rather than add. */
static void tile2(const int32_t* a, const int32_t* b, int64_t pairs, float* c, int64_t ldc, int first) {
    I16_ROWS(ZERO2)
    for (int64_t p = 0; p < pairs; p++) {
        const vint b0 = vi_load(b + p * I16_NR), b1 = vi_load(b + p * I16_NR + VL);
        I16_ROWS(STEP2)
    }
    I16_ROWS(FLUSH2)
}

/* The same for the first VL columns only (a block of columns' tail). */
static void tile1(const int32_t* a, const int32_t* b, int64_t pairs, float* c, int64_t ldc, int first) {
    I16_ROWS(ZERO1)
    for (int64_t p = 0; p < pairs; p++) {
        const vint b0 = vi_load(b + p * I16_NR);
        I16_ROWS(STEP1)
    }
    I16_ROWS(FLUSH1)
}

/* y [M][N] (dt) = x [M][K] (dt) . (w [N][K] int8 * scale[N] (dt))^T (+ bias[N] (dt)).
 * Returns 0, -1 when out of memory, -2 for shapes it does not take (K odd, N % VL). */
int qvl_i16_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const int8_t* w, const void* scale,
                   const void* bias, void* y, int threads) {
    if (K % 2 || N % VL || M < 1 || K < 2) return -2;
    const int64_t MB = (M + I16_MR - 1) / I16_MR, P = K / 2, T = threads < 1 ? 1 : threads;
    int32_t* a = aligned_alloc(64, (size_t)(MB * P * I16_MR * 4 + 63) / 64 * 64); /* a multiple of the alignment */
    float* s = malloc((size_t)(MB * I16_MR) * sizeof(float));
    float *cs = NULL, *cb = NULL; /* the columns' scales and biases in float32 */
    if (!a || !s || qvl_rescale_columns(scale, bias, dt, N, &cs, &cb)) {
        free(a), free(s);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(T)
    {
        float* buf = malloc((size_t)K * sizeof(float));
        int16_t* codes = malloc((size_t)K * sizeof(int16_t));
        if (!buf || !codes) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4) /* blocks of rows in turn, as take_item */
        for (int64_t mb = 0; mb < MB; mb++)
            if (buf && codes) pack_rows(x, dt, M, K, mb * I16_MR, a + mb * P * I16_MR, s + mb * I16_MR, buf, codes);
        free(buf), free(codes);
    }
    if (failed) {
        free(a), free(s), free(cs);
        return -1;
    }
    const int64_t tiles = (N + I16_NR - 1) / I16_NR, chunk = chunk_blocks(K * 2 * I16_MR);
    const int64_t items = (MB + chunk - 1) / chunk * tiles;
    int64_t next = 0;
#pragma omp parallel num_threads(T)
    {
        /* as the byte kernel below: a column tile's widened weights over the whole of K (K * 64
         * bytes, L2) under every row block of a chunk; the int32 sums go to the tile's float
         * totals (6-10 rows x 32 columns, L1) every I16_KC inputs */
        int32_t* b = aligned_alloc(64, (size_t)(P * I16_NR * 4 + 63) / 64 * 64);
        if (!b) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t item; b && (item = take_item(&next, items)) >= 0;) {
            const int64_t mb0 = item / tiles * chunk, n0 = item % tiles * I16_NR;
            const int64_t nr = N - n0 < I16_NR ? N - n0 : I16_NR;
            float c[I16_MR * I16_NR];
            weight_panel(w, K, n0, nr, 0, K, 2, b);
            for (int64_t mb = mb0; mb < MB && mb < mb0 + chunk; mb++) {
                const int64_t m0 = mb * I16_MR, rows = M - m0 < I16_MR ? M - m0 : I16_MR;
                for (int64_t k0 = 0; k0 < K; k0 += I16_KC) {
                    const int64_t pairs = (K - k0 < I16_KC ? K - k0 : I16_KC) / 2;
                    const int32_t* am = a + (mb * P + k0 / 2) * I16_MR;
                    if (nr == I16_NR)
                        tile2(am, b + k0 / 2 * I16_NR, pairs, c, I16_NR, k0 == 0);
                    else
                        tile1(am, b + k0 / 2 * I16_NR, pairs, c, I16_NR, k0 == 0);
                }
                write_rows(c, I16_NR, s + m0, rows, n0, nr, cs + n0, cb + n0, dt, N, 0, NULL,
                           (char*)y + m0 * N * (dt == BF16 ? 2 : 4));
            }
        }
        free(b);
    }
    free(a), free(s), free(cs);
    return failed ? -1 : 0;
}


#endif /* the pair kernel: x86 */

/* ---- 8-bit activation codes per group of columns (VNNI, NEON dot products) ---------------
 * Each row of x is split into groups of `group` columns, each quantised symmetrically to int8
 * codes (step max|group| / 127: outlier channels coarsen only their own group). vpdpbusd takes
 * unsigned bytes times signed ones, so the weight panel holds w + 128 (1..255) and the codes
 * stay signed: a group's int32 sum starts at -128 * (the sum of its codes), which leaves the
 * exact sum of w . q (|sum| <= 128 * 255 * 127 < 2^31). Each group's sum is multiplied by its
 * step and added in float32 in a fixed order, so a row's result again depends neither on the
 * other rows nor on the thread count. vpdpbusd multiplies four byte pairs per 32-bit lane:
 * twice vpdpwssd's products per instruction.
 *
 * Blocking: the threads take the output columns 32 at a time (take_item) over the whole of K:
 * the tile's weights (K * 32 bytes, w + 128 as quads) are laid out once and stay in L2 while
 * every block of 6 rows runs over them, the block's float totals in registers from the first
 * group to the last, its results written out (with the fused GELU and residual) at once.
 * Unlike the pair kernel's panels, no float partial sums go through memory: for 1008 rows they
 * were 1 MB per thread, past L2, and with two threads 0.87-0.9x of the time went with them.
 *
 * Plain AVX2 (no VNNI) multiplies the same bytes with vpmaddubsw, whose pairs of products are
 * summed in 16 bits with saturation: (w + 128) . q over a pair stays below 2^15 only for codes
 * |q| <= 63 (2 * 255 * 63 = 32130), so there the codes are 7-bit (step max|group| / 63); then
 * vpmaddwd by ones widens the pair sums to int32, still exact. Three instructions per 32
 * multiply-adds against the 16-bit pair kernel's two per 16; on cores that run vpmaddwd and
 * vpmaddubsw on two ports and vpaddd on three (Intel's), 1.15-1.37x its products per call
 * (docs/decisions/prefill-products.md). */
#if (defined(QVL_AVX512) && defined(__AVX512VNNI__)) || defined(QVL_AVX2) || defined(QVL_NEON)
#define QVL_Q8 1
#if defined(QVL_AVX2) && !defined(__AVXVNNI__)
#define Q8_LEVELS 63 /* vpmaddubsw: 7-bit codes */
#else
#define Q8_LEVELS 127
#endif

#define Q8_MR 6   /* rows per register block: 2 x 6 int32 sums and 2 x 6 float32 totals */
#if defined(QVL_NEON) && defined(__ARM_FEATURE_MATMUL_INT8)
#define Q8_UNIT 8 /* codes of a row per step: smmla (i8mm) takes 8 (rows in pairs), the dot products 4 */
#else
#define Q8_UNIT 4
#endif
#define Q8_ROWS I16_ROWS_6

#if defined(QVL_AVX512)
static inline vint vi_dp8(vint acc, vint w, vint a) { /* acc += per lane: 4 bytes w (unsigned) . a (signed) */
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
    return acc;
}
#elif defined(QVL_AVX2) && defined(__AVXVNNI__)
static inline vint vi_dp8(vint acc, vint w, vint a) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(a));
    return acc;
}
#elif defined(QVL_AVX2)
static const int16_t q8_ones[16] __attribute__((aligned(32))) = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
/* vpmaddubsw (pairs of w . a in int16: exact for 7-bit codes), vpmaddwd by ones from memory (the
 * register block uses all 16 ymm registers), vpaddd */
static inline vint vi_dp8(vint acc, vint w, vint a) {
    vint t;
    __asm__("vpmaddubsw %3, %2, %1\n\tvpmaddwd %4, %1, %1\n\tvpaddd %1, %0, %0"
            : "+x"(acc), "=&x"(t) : "x"(w), "x"(a), "m"(*(const __m256i*)q8_ones));
    return acc;
}
#endif

/* Row r's int8 codes[K] into its block's layout a (K * Q8_MR bytes): quads a[K/4][Q8_MR] (quad p
 * of row r at a[p * Q8_MR + r]) for the dot products; for smmla octets in row pairs, [K/8][Q8_MR/2]
 * of 16 bytes (row 2j's 8 codes, then row 2j + 1's). */
static inline void place_codes(int32_t* a, const int8_t* codes, int64_t K, int r) {
#if Q8_UNIT == 8
    for (int64_t o = 0; o < K / 8; o++) memcpy((int8_t*)a + o * 8 * Q8_MR + (r / 2) * 16 + (r % 2) * 8, codes + 8 * o, 8);
#else
    for (int64_t p = 0; p < K / 4; p++) memcpy(a + p * Q8_MR + r, codes + 4 * p, 4); /* one quad */
#endif
}

/* Rows m0..m0+Q8_MR-1 of x (dt [M][K], K % Q8_UNIT == 0; rows past M zero), layer-normalised
 * first when nw (float32 [K], with nb) is given -> int8 codes in a (place_codes), each group's
 * step sg[G][Q8_MR] and -128 * its codes' sum nq[G][Q8_MR], G = ceil(K / group). */
static void pack_groups(const void* x, int dt, int64_t M, int64_t K, int64_t group, const float* nw,
                        const float* nb, float eps, int64_t m0, int32_t* a, float* sg, int32_t* nq, float* buf,
                        int8_t* codes) {
    const int64_t G = (K + group - 1) / group;
    for (int r = 0; r < Q8_MR; r++) {
        const float* row = buf;
        int finite = 1;
        if (m0 + r < M) {
            row = row_f32(x, dt, K, m0 + r, buf, &finite);
            if (nw) { /* layer-normalised first, as the model's module would (rounded to dt) */
                if (row != buf) memcpy(buf, row, (size_t)K * sizeof(float));
                qvl_layer_norm_row(buf, K, nw, nb, eps, dt);
                row = buf, finite = all_finite(buf, K);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            const int64_t k0 = g * group, n = K - k0 < group ? K - k0 : group;
            const float top = m0 + r < M && finite ? absmax(row + k0, n) : 0.f, inv = top > 0.f ? Q8_LEVELS / top : 0.f;
            /* rows past M, zero groups and groups too small for Q8_LEVELS / top to be finite add
             * nothing; a row with NaN or infinity gives NaN (its steps); their codes stay 0 */
            const int coded = top > 0.f && inv <= FLT_MAX;
            int32_t sum = 0;
            if (coded) {
#pragma omp simd reduction(+ : sum)
                for (int64_t k = 0; k < n; k++) {
                    const int32_t q = round_int(row[k0 + k] * inv); /* |q| <= Q8_LEVELS */
                    codes[k0 + k] = (int8_t)q, sum += q;
                }
            } else {
                memset(codes + k0, 0, (size_t)n);
            }
            sg[g * Q8_MR + r] = !finite ? NAN : coded ? top / Q8_LEVELS : 0.f;
            nq[g * Q8_MR + r] = -128 * sum;
        }
        place_codes(a, codes, K, r);
    }
}

#if defined(QVL_AVX512) || defined(QVL_AVX2)
/* The register block, per row r: group sums c (first vector of columns) and d (second) in
 * int32, totals e and f in float32; a group's sums start at its nq and end scaled into e, f. */
#define Q8_DECL2(r) vint c##r, d##r; vflt e##r = vf_set1(0.f), f##r = e##r;
#define Q8_DECL1(r) vint c##r; vflt e##r = vf_set1(0.f);
#define Q8_START2(r) c##r = vi_set1(nq[g * Q8_MR + (r)]), d##r = c##r;
#define Q8_START1(r) c##r = vi_set1(nq[g * Q8_MR + (r)]);
#define Q8_STEP2(r)                                               \
    {                                                             \
        const vint av = vi_set1(a[p * Q8_MR + (r)]);              \
        c##r = vi_dp8(c##r, b0, av), d##r = vi_dp8(d##r, b1, av); \
    }
#define Q8_STEP1(r) c##r = vi_dp8(c##r, b0, vi_set1(a[p * Q8_MR + (r)]));
#define Q8_SCALE2(r)                                  \
    {                                                 \
        const vflt sv = vf_set1(sg[g * Q8_MR + (r)]); \
        e##r = vf_fmadd(vf_of(c##r), sv, e##r);       \
        f##r = vf_fmadd(vf_of(d##r), sv, f##r);       \
    }
#define Q8_SCALE1(r) e##r = vf_fmadd(vf_of(c##r), vf_set1(sg[g * Q8_MR + (r)]), e##r);
#define Q8_OUT(acc, r, off) vf_store(c + (r) * I16_NR + (off), acc);
#define Q8_OUT2(r) Q8_OUT(e##r, r, 0) Q8_OUT(f##r, r, VL)
#define Q8_OUT1(r) Q8_OUT(e##r, r, 0)

/* c[r][0 .. 2 VL) = the sum over groups of gq quads of each group's exact sum of
 * a [quads][Q8_MR] . b [quads][I16_NR] times its step (sg, nq: [groups][Q8_MR]); c is
 * [Q8_MR][I16_NR]. */
static void q8_tile2(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, float* c) {
    Q8_ROWS(Q8_DECL2)
    for (int64_t g = 0, q0 = 0; q0 < quads; g++, q0 += gq) {
        Q8_ROWS(Q8_START2)
        for (int64_t p = q0; p < q0 + gq && p < quads; p++) {
            const vint b0 = vi_load(b + p * I16_NR), b1 = vi_load(b + p * I16_NR + VL);
            Q8_ROWS(Q8_STEP2)
        }
        Q8_ROWS(Q8_SCALE2)
    }
    Q8_ROWS(Q8_OUT2)
}

/* The same for the first VL columns only (a block of columns' tail). */
static void q8_tile1(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, float* c) {
    Q8_ROWS(Q8_DECL1)
    for (int64_t g = 0, q0 = 0; q0 < quads; g++, q0 += gq) {
        Q8_ROWS(Q8_START1)
        for (int64_t p = q0; p < q0 + gq && p < quads; p++) {
            const vint b0 = vi_load(b + p * I16_NR);
            Q8_ROWS(Q8_STEP1)
        }
        Q8_ROWS(Q8_SCALE1)
    }
    Q8_ROWS(Q8_OUT1)
}

/* The tile's weights: w rows n0..n0+nr-1 as quads b[K/4][I16_NR] (w + 128: vpdpbusd's unsigned operand). */
static inline void q8_panel(const int8_t* w, int64_t K, int64_t n0, int64_t nr, int32_t* b) {
    weight_panel(w, K, n0, nr, 0, K, 4, b);
}
#else
/* NEON: sdot multiplies signed bytes by signed bytes, so the weights stay as they are (nq, the
 * x86 kernels' offset, is not used) and each group's int32 sum is the exact sum of w . q
 * (|sum| <= 256 * 128 * 127 < 2^31 at groups of up to 256). The register block: 6 rows x 8
 * columns (two int32x4 of sums and two float32x4 of totals per row), each row's quad of
 * codes taken by lane from one 16-byte (rows 0-3) or 8-byte (rows 4-5) load: 12 sdot per 4
 * loads. The same integer sums and the same float32 operations in the same order as on x86:
 * the same product bits (the fused layer norm's sums and GELU follow each build's vectors). */

#if Q8_UNIT == 8
/* With i8mm, smmla multiplies a 2 x 8 block of codes (two rows) by an 8 x 2 block of weights (two
 * columns) into a 2 x 2 block of int32 sums: 32 multiply-adds per instruction, twice sdot's. The
 * register block stays 6 rows x 8 columns: 3 row pairs x 4 column pairs of 2 x 2 sums and as
 * many float32 totals, 3 + 4 loads per 12 smmla per 8 codes. A group's sums are scaled per row
 * (the step vector [s_r, s_r, s_r+1, s_r+1]) and added in one fmla: per output element the
 * same integer sum and float operation as the dot-product kernels, the same product bits. */

/* The tile's weights: w rows n0..n0+nr-1 as octets b[K/8][I16_NR][8 bytes] (columns past nr zero). */
static inline void q8_panel(const int8_t* w, int64_t K, int64_t n0, int64_t nr, int32_t* b) {
    int8_t* bb = (int8_t*)b;
    for (int64_t o = 0; o < K / 8; o++)
        for (int64_t i = 0; i < I16_NR; i++) {
            if (i < nr)
                memcpy(bb + (o * I16_NR + i) * 8, w + (n0 + i) * K + 8 * o, 8);
            else
                memset(bb + (o * I16_NR + i) * 8, 0, 8);
        }
}

#define Q8M_BLOCKS2(X) X(0, 0) X(0, 1) X(0, 2) X(0, 3) X(1, 0) X(1, 1) X(1, 2) X(1, 3) X(2, 0) X(2, 1) X(2, 2) X(2, 3)
#define Q8M_BLOCKS1(X) X(0, 0) X(0, 1) X(1, 0) X(1, 1) X(2, 0) X(2, 1)
#define Q8M_DECL(p, q) int32x4_t c##p##q; float32x4_t e##p##q = vdupq_n_f32(0.f);
#define Q8M_ZERO(p, q) c##p##q = vdupq_n_s32(0);
#define Q8M_STEP(p, q) c##p##q = vmmlaq_s32(c##p##q, a##p, b##q);
#define Q8M_SCALE(p, q) e##p##q = vfmaq_f32(e##p##q, vcvtq_f32_s32(c##p##q), s##p);
#define Q8M_OUT(p, q)                                                     \
    vst1_f32(c + (2 * (p)) * I16_NR + 2 * (q), vget_low_f32(e##p##q));     \
    vst1_f32(c + (2 * (p) + 1) * I16_NR + 2 * (q), vget_high_f32(e##p##q));
#define Q8M_PAIR_STEPS(g)                                                                                   \
    const float32x4_t s0 = vcombine_f32(vdup_n_f32(sg[(g) * Q8_MR]), vdup_n_f32(sg[(g) * Q8_MR + 1]));     \
    const float32x4_t s1 = vcombine_f32(vdup_n_f32(sg[(g) * Q8_MR + 2]), vdup_n_f32(sg[(g) * Q8_MR + 3])); \
    const float32x4_t s2 = vcombine_f32(vdup_n_f32(sg[(g) * Q8_MR + 4]), vdup_n_f32(sg[(g) * Q8_MR + 5]));

/* c[r][0 .. 2 VL) = the sum over groups of gq quads (gq / 2 octets) of each group's exact sum of
 * the codes a (place_codes) . the weights b (q8_panel) times its step (sg: [groups][Q8_MR]); c is
 * [Q8_MR][I16_NR]. */
static void q8_tile2(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, float* c) {
    (void)nq;
    const int8_t *ab = (const int8_t*)a, *bb = (const int8_t*)b;
    const int64_t octets = quads / 2, go = gq / 2;
    Q8M_BLOCKS2(Q8M_DECL)
    for (int64_t g = 0, o0 = 0; o0 < octets; g++, o0 += go) {
        Q8M_BLOCKS2(Q8M_ZERO)
        for (int64_t o = o0; o < o0 + go && o < octets; o++) {
            const int8x16_t a0 = vld1q_s8(ab + o * 48), a1 = vld1q_s8(ab + o * 48 + 16), a2 = vld1q_s8(ab + o * 48 + 32);
            const int8x16_t b0 = vld1q_s8(bb + o * 64), b1 = vld1q_s8(bb + o * 64 + 16);
            const int8x16_t b2 = vld1q_s8(bb + o * 64 + 32), b3 = vld1q_s8(bb + o * 64 + 48);
            Q8M_BLOCKS2(Q8M_STEP)
        }
        Q8M_PAIR_STEPS(g)
        Q8M_BLOCKS2(Q8M_SCALE)
    }
    Q8M_BLOCKS2(Q8M_OUT)
}

/* The same for the first VL columns only (a block of columns' tail). */
static void q8_tile1(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, float* c) {
    (void)nq;
    const int8_t *ab = (const int8_t*)a, *bb = (const int8_t*)b;
    const int64_t octets = quads / 2, go = gq / 2;
    Q8M_BLOCKS1(Q8M_DECL)
    for (int64_t g = 0, o0 = 0; o0 < octets; g++, o0 += go) {
        Q8M_BLOCKS1(Q8M_ZERO)
        for (int64_t o = o0; o < o0 + go && o < octets; o++) {
            const int8x16_t a0 = vld1q_s8(ab + o * 48), a1 = vld1q_s8(ab + o * 48 + 16), a2 = vld1q_s8(ab + o * 48 + 32);
            const int8x16_t b0 = vld1q_s8(bb + o * 64), b1 = vld1q_s8(bb + o * 64 + 16);
            Q8M_BLOCKS1(Q8M_STEP)
        }
        Q8M_PAIR_STEPS(g)
        Q8M_BLOCKS1(Q8M_SCALE)
    }
    Q8M_BLOCKS1(Q8M_OUT)
}
#else
/* The tile's weights: w rows n0..n0+nr-1 as quads b[K/4][I16_NR] (4 bytes of one row each;
 * columns past nr zero). */
static inline void q8_panel(const int8_t* w, int64_t K, int64_t n0, int64_t nr, int32_t* b) {
    for (int64_t p = 0; p < K / 4; p++)
        for (int64_t i = 0; i < I16_NR; i++) {
            int32_t d = 0;
            if (i < nr) memcpy(&d, w + (n0 + i) * K + 4 * p, 4);
            b[p * I16_NR + i] = d;
        }
}

#define Q8_NEON_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define Q8N_DECL2(r) int32x4_t c##r, d##r; float32x4_t e##r = vdupq_n_f32(0.f), f##r = e##r;
#define Q8N_DECL1(r) int32x4_t c##r; float32x4_t e##r = vdupq_n_f32(0.f);
#define Q8N_ZERO2(r) c##r = vdupq_n_s32(0), d##r = c##r;
#define Q8N_ZERO1(r) c##r = vdupq_n_s32(0);
#define Q8N_SCALE2(r)                                       \
    e##r = vfmaq_n_f32(e##r, vcvtq_f32_s32(c##r), sg[g * Q8_MR + (r)]); \
    f##r = vfmaq_n_f32(f##r, vcvtq_f32_s32(d##r), sg[g * Q8_MR + (r)]);
#define Q8N_SCALE1(r) e##r = vfmaq_n_f32(e##r, vcvtq_f32_s32(c##r), sg[g * Q8_MR + (r)]);
#define Q8N_OUT2(r) vst1q_f32(c + (r) * I16_NR, e##r), vst1q_f32(c + (r) * I16_NR + VL, f##r);
#define Q8N_OUT1(r) vst1q_f32(c + (r) * I16_NR, e##r);

/* c[r][0 .. 2 VL) = the sum over groups of gq quads of each group's exact sum of
 * a [quads][Q8_MR] . b [quads][I16_NR] times its step (sg: [groups][Q8_MR]); c is
 * [Q8_MR][I16_NR]. */
static void q8_tile2(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, float* c) {
    (void)nq;
    Q8_NEON_ROWS(Q8N_DECL2)
    for (int64_t g = 0, q0 = 0; q0 < quads; g++, q0 += gq) {
        Q8_NEON_ROWS(Q8N_ZERO2)
        for (int64_t p = q0; p < q0 + gq && p < quads; p++) {
            const int8x16_t b0 = vld1q_s8((const int8_t*)(b + p * I16_NR));
            const int8x16_t b1 = vld1q_s8((const int8_t*)(b + p * I16_NR + VL));
            const int8x16_t lo = vld1q_s8((const int8_t*)(a + p * Q8_MR)); /* rows 0-3 */
            const int8x8_t hi = vld1_s8((const int8_t*)(a + p * Q8_MR + 4)); /* rows 4-5 */
            c0 = vdotq_laneq_s32(c0, b0, lo, 0), d0 = vdotq_laneq_s32(d0, b1, lo, 0);
            c1 = vdotq_laneq_s32(c1, b0, lo, 1), d1 = vdotq_laneq_s32(d1, b1, lo, 1);
            c2 = vdotq_laneq_s32(c2, b0, lo, 2), d2 = vdotq_laneq_s32(d2, b1, lo, 2);
            c3 = vdotq_laneq_s32(c3, b0, lo, 3), d3 = vdotq_laneq_s32(d3, b1, lo, 3);
            c4 = vdotq_lane_s32(c4, b0, hi, 0), d4 = vdotq_lane_s32(d4, b1, hi, 0);
            c5 = vdotq_lane_s32(c5, b0, hi, 1), d5 = vdotq_lane_s32(d5, b1, hi, 1);
        }
        Q8_NEON_ROWS(Q8N_SCALE2)
    }
    Q8_NEON_ROWS(Q8N_OUT2)
}

/* The same for the first VL columns only (a block of columns' tail). */
static void q8_tile1(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, float* c) {
    (void)nq;
    Q8_NEON_ROWS(Q8N_DECL1)
    for (int64_t g = 0, q0 = 0; q0 < quads; g++, q0 += gq) {
        Q8_NEON_ROWS(Q8N_ZERO1)
        for (int64_t p = q0; p < q0 + gq && p < quads; p++) {
            const int8x16_t b0 = vld1q_s8((const int8_t*)(b + p * I16_NR));
            const int8x16_t lo = vld1q_s8((const int8_t*)(a + p * Q8_MR));
            const int8x8_t hi = vld1_s8((const int8_t*)(a + p * Q8_MR + 4));
            c0 = vdotq_laneq_s32(c0, b0, lo, 0), c1 = vdotq_laneq_s32(c1, b0, lo, 1);
            c2 = vdotq_laneq_s32(c2, b0, lo, 2), c3 = vdotq_laneq_s32(c3, b0, lo, 3);
            c4 = vdotq_lane_s32(c4, b0, hi, 0), c5 = vdotq_lane_s32(c5, b0, hi, 1);
        }
        Q8_NEON_ROWS(Q8N_SCALE1)
    }
    Q8_NEON_ROWS(Q8N_OUT1)
}
#endif /* i8mm or dot products */
#endif

/* y [M][N] (dt) = x [M][K] (dt) . (w [N][K] int8 * scale[N] (dt))^T (+ bias[N] (dt)), x in
 * 8-bit codes per `group` columns. Fused around it, as the vision tower's layers ask: with
 * norm_w (dt [K], and norm_b or NULL) x's rows are layer-normalised first (never written);
 * `gelu` applies tanh-GELU to the result and `residual` ([M][N] dt, or NULL) is added to it
 * (write_rows). Returns 0, -1 when out of memory, -2 for shapes it does not take (K or the
 * group size not a multiple of Q8_UNIT, a group past 256, N % VL). */
int qvl_q8_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const int8_t* w, const void* scale,
                  const void* bias, void* y, int threads, int group, const void* norm_w, const void* norm_b, float eps,
                  int gelu, const void* residual) {
    if (K % Q8_UNIT || N % VL || M < 1 || K < 4 || group < Q8_UNIT || group % Q8_UNIT || group > 256) return -2;
    const int64_t MB = (M + Q8_MR - 1) / Q8_MR, Q = K / 4, G = (K + group - 1) / group, T = threads < 1 ? 1 : threads;
    int32_t* a = aligned_alloc(64, (size_t)(MB * Q * Q8_MR * 4 + 63) / 64 * 64);
    float* sg = malloc((size_t)(MB * G * Q8_MR) * sizeof(float));
    int32_t* nq = malloc((size_t)(MB * G * Q8_MR) * sizeof(int32_t));
    float *nw = NULL, *nb = NULL, *cs = NULL, *cb = NULL; /* the norm's and the columns' factors in float32 */
    if (!a || !sg || !nq || (norm_w && qvl_rescale_columns(norm_w, norm_b, dt, K, &nw, &nb)) ||
        qvl_rescale_columns(scale, bias, dt, N, &cs, &cb)) {
        free(a), free(sg), free(nq), free(nw);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(T)
    {
        float* buf = malloc((size_t)K * sizeof(float));
        int8_t* codes = malloc((size_t)K);
        if (!buf || !codes) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4) /* blocks of rows in turn, as take_item */
        for (int64_t mb = 0; mb < MB; mb++)
            if (buf && codes)
                pack_groups(x, dt, M, K, group, nw, nb, eps, mb * Q8_MR, a + mb * Q * Q8_MR, sg + mb * G * Q8_MR,
                            nq + mb * G * Q8_MR, buf, codes);
        free(buf), free(codes);
    }
    if (failed) {
        free(a), free(sg), free(nq), free(nw), free(cs);
        return -1;
    }
    const int64_t gq = group / 4, tiles = (N + I16_NR - 1) / I16_NR, chunk = chunk_blocks(K * Q8_MR);
    const int64_t items = (MB + chunk - 1) / chunk * tiles;
    int64_t next = 0;
#pragma omp parallel num_threads(T)
    {
        /* one column tile at a time over the whole of K: its weights (K * 32 bytes) stay in L2
         * while the row blocks of a chunk (their codes too: ROW_CHUNK bytes) run over them, each
         * block's float totals in registers from the first group to the last, its 6 x 32
         * results written out at once; (chunk, tile) pairs taken in turn (take_item), each
         * tile's weights laid out again per chunk (a few % of the products' time, against the
         * codes of every row streaming from memory per tile) */
        int32_t* b = aligned_alloc(64, (size_t)(Q * I16_NR * 4 + 63) / 64 * 64);
        if (!b) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t item; b && (item = take_item(&next, items)) >= 0;) {
            const int64_t mb0 = item / tiles * chunk, n0 = item % tiles * I16_NR;
            const int64_t nr = N - n0 < I16_NR ? N - n0 : I16_NR;
            float c[Q8_MR * I16_NR];
            q8_panel(w, K, n0, nr, b);
            for (int64_t mb = mb0; mb < MB && mb < mb0 + chunk; mb++) {
                const int64_t m0 = mb * Q8_MR, rows = M - m0 < Q8_MR ? M - m0 : Q8_MR;
                const int32_t* am = a + mb * Q * Q8_MR;
                if (nr == I16_NR)
                    q8_tile2(am, b, Q, gq, sg + mb * G * Q8_MR, nq + mb * G * Q8_MR, c);
                else
                    q8_tile1(am, b, Q, gq, sg + mb * G * Q8_MR, nq + mb * G * Q8_MR, c);
                write_rows(c, I16_NR, NULL, rows, n0, nr, cs + n0, cb + n0, dt, N, gelu, /* steps in c */
                           residual ? (const char*)residual + m0 * N * (dt == BF16 ? 2 : 4) : NULL,
                           (char*)y + m0 * N * (dt == BF16 ? 2 : 4));
            }
        }
        free(b);
    }
    free(a), free(sg), free(nq), free(nw), free(cs);
    return failed ? -1 : 0;
}

int qvl_q8_levels(void) { return Q8_LEVELS; }
#endif /* byte products */

#endif

#ifndef QVL_I16 /* no pair products (ARM, portable C) */
int qvl_i16_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const int8_t* w, const void* scale,
                   const void* bias, void* y, int threads) {
    (void)x, (void)dt, (void)M, (void)K, (void)N, (void)w, (void)scale, (void)bias, (void)y, (void)threads;
    return -2;
}
#endif

#ifndef QVL_Q8 /* no byte products: prefill keeps 16-bit codes */
int qvl_q8_levels(void) { return 0; }
int qvl_q8_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const int8_t* w, const void* scale,
                  const void* bias, void* y, int threads, int group, const void* norm_w, const void* norm_b, float eps,
                  int gelu, const void* residual) {
    (void)x, (void)dt, (void)M, (void)K, (void)N, (void)w, (void)scale, (void)bias, (void)y, (void)threads, (void)group;
    (void)norm_w, (void)norm_b, (void)eps, (void)gelu, (void)residual;
    return -2;
}
#endif
