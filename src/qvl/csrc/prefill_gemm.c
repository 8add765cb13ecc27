/* Many-row products with int8 weights where the CPU has no AMX (prefill on AVX-512 and AVX2):
 * y = x . (w * scale)^T (+ bias), the activations in 16-bit codes per row (qvl_i16_linear); with VNNI
 * (and on ARM) byte_gemm.c's kernel takes them in 8-bit codes per group of columns instead.
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
#include "prefill_gemm.h"
#include "quantise.h"

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
        int coded;
        s[r] = row_codes16(row, K, finite, top, codes, &coded);
        if (!coded) {
            for (int64_t p = 0; p < K / 2; p++) a[p * I16_MR + r] = 0;
            continue;
        }
        for (int64_t p = 0; p < K / 2; p++) memcpy(a + p * I16_MR + r, codes + 2 * p, 4); /* one pair */
    }
}

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
        /* as byte_gemm.c's kernel: a column tile's widened weights over the whole of K (K * 64
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
            weight_panel(w, K, n0, nr, 0, K, PANEL_PAIRS, b);
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

#ifndef QVL_I16 /* no pair products (ARM, portable C) */
int qvl_i16_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const int8_t* w, const void* scale,
                   const void* bias, void* y, int threads) {
    (void)x, (void)dt, (void)M, (void)K, (void)N, (void)w, (void)scale, (void)bias, (void)y, (void)threads;
    return -2;
}
#endif
