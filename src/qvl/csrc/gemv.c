/* Matrix products of a few activation rows (decoding) against bf16, int8 or int4 weights,
 * and one-pass dequantisation (prefill multiplies the dequantised matrix with oneDNN).
 *
 * Layouts (row-major, one row per output channel n):
 *   bf16 weights  w[N][K] uint16
 *   int8 weights  w[N][K] int8, scale[N]                       w = q * scale
 *   int4 weights  w[N][K/2] uint8 (column 2i in the low nibble of byte i, 2i+1 in the high),
 *                 scale[N][K/g], zero[N][K/g]                  w = (q - 8) * scale + zero
 * Activations x[M][K] and outputs y[M][N] are float32 (dt 0) or bfloat16 (dt 1); scales,
 * zeros and bias use the same dtype.
 *
 * Integer products on every tier, with the same quantised activations (when K is a
 * multiple of 128), so that tiers differ only in the order of float sums:
 *   int8: activations rounded to 16 bits per 128 columns (finer than bf16); the weights are
 *         widened to int16 and multiplied in pairs (AVX-512 VNNI and AVX-VNNI vpdpwssd,
 *         AVX2 vpmaddwd, NEON smlal), portable C sums int32 products.
 *   int4: activations rounded to int8 per 128 columns, as llama.cpp does for its 4-bit
 *         formats (VNNI / vpmaddubsw / NEON sdot / portable int32 sums).
 * bf16 weights, and shapes the integer paths do not take, accumulate exact float products. */
#include "gemv.h"

/* ---- portable row products ----------------------------------------------------------------- */

static float dot_bf16(const float* x, const uint16_t* w, int64_t K) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; k++) s += bf16_to_f32(w[k]) * x[k];
    return s;
}

static float dot_int8_float(const float* x, const int8_t* w, int64_t K) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; k++) s += (float)w[k] * x[k];
    return s;
}

static inline float int4_at(const uint8_t* row, int64_t k) {
    uint8_t b = row[k >> 1];
    return (float)((k & 1) ? (b >> 4) : (b & 0x0F));
}

static float dot_int4_float(const float* x, const uint8_t* w, const void* sc, const void* zr, int dt, int64_t K,
                            int64_t gs) {
    float total = 0.f;
    for (int64_t g = 0; g < K / gs; g++) {
        float s = get(sc, dt, g), z = get(zr, dt, g), part = 0.f;
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) part += ((int4_at(w, k) - 8.f) * s + z) * x[k];
        total += part;
    }
    return total;
}

/* int8 weights . 16-bit activations, summed exactly per chunk. */
static inline float dot_int8_q16(const Q16* qx, int64_t m, int64_t K, const int8_t* w) {
    const int64_t C = K / CHUNK;
    float total = 0.f;
    for (int64_t c = 0; c < C; c++) {
        const int16_t* xq = qx->q + m * K + c * CHUNK;
        const int8_t* wc = w + c * CHUNK;
        int32_t s = 0;
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < CHUNK; j++) s += (int32_t)wc[j] * (int32_t)xq[j];
        total += (float)s * qx->scale[m * C + c];
    }
    return total;
}

/* int4 weights . int8 activations: per 128-column chunk and weight group, an exact integer
 * sum (low nibble of byte i <-> even column 2i <-> xq[i], high <-> odd <-> xq[64 + i]). */
static inline float dot_int4_q8(const QuantX* qx, int64_t m, int64_t K, int64_t gs, const uint8_t* w, const void* sc,
                         const void* zr, int dt) {
    const int64_t C = K / CHUNK, G = K / gs, span = gs < CHUNK ? gs : CHUNK; /* columns per (chunk, group) */
    float total = 0.f;
    for (int64_t c = 0; c < C; c++) {
        const int8_t* xq = qx->q + m * K + c * CHUNK;
        const uint8_t* wc = w + c * (CHUNK / 2);
        const float xs = qx->scale[m * C + c];
        for (int64_t b0 = 0; b0 < CHUNK / 2; b0 += span / 2) {
            int32_t s = 0;
#pragma omp simd reduction(+ : s)
            for (int64_t i = b0; i < b0 + span / 2; i++)
                s += (int32_t)(wc[i] & 0x0F) * xq[i] + (int32_t)(wc[i] >> 4) * xq[CHUNK / 2 + i];
            total += (float)s * xs * get(sc, dt, (c * CHUNK + 2 * b0) / gs);
        }
    }
    const float* xsum = qx->sum + m * G;
    for (int64_t g = 0; g < G; g++) total += (get(zr, dt, g) - 8.f * get(sc, dt, g)) * xsum[g];
    return total;
}

#if defined(QVL_AVX512) || defined(QVL_AVX2)
/* The first chunk from c0 on that the int8 products' prefetch asks for: the one with
 * c % every == phase (a tile of activation rows asks for every every-th chunk). */
static inline int64_t first_prefetch(int64_t c0, int64_t every, int64_t phase) {
    return c0 + ((phase - c0 % every) % every + every) % every;
}

/* Where the int8 products' prefetch brings the next block's weights: into L2 only on AVX-512
 * (a block ahead is 48 rows, 96-288 KB, far more than L1 holds; asked into L1 the one-row
 * decode step took 1.33x as long on a Zen 4, 4 rows 1.37x, 8 rows 1.09x), into L1 on AVX2
 * (measured the same there, emulated on that Zen 4). */
#ifdef QVL_AVX512
#define WEIGHT_PREFETCH _MM_HINT_T1
#else
#define WEIGHT_PREFETCH _MM_HINT_T0
#endif

/* Asks for chunk c of nr weight rows (K apart) from pf, when c is *next (then the next one
 * is every chunks on): the int8 products' prefetch, spread over the chunks so that memory
 * streams under the products (a counter, not c % every: that was a division per chunk). */
static inline __attribute__((always_inline)) void prefetch_chunk(const int8_t* pf, int64_t K, int64_t c,
                                                                 int64_t every, int64_t* next, const int nr) {
    if (!pf || c != *next) return;
    *next += every;
    for (int r = 0; r < nr; r++) {
        _mm_prefetch((const char*)(pf + r * K + c * CHUNK), WEIGHT_PREFETCH);
        _mm_prefetch((const char*)(pf + r * K + c * CHUNK + 64), WEIGHT_PREFETCH);
    }
}
#endif

/* ---- AVX-512 row products ---------------------------------------------------------------- */
#ifdef QVL_AVX512

static inline __m512 load16_weights(const void* w, int64_t k, const int kind) {
    if (kind == W_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)w + k))));
    return bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)w + k)));
}

/* out[m] = sum_k w[k] * x[m][k] for mt <= TILE rows; four accumulators per row hide the
 * FMA latency. Inlined with constant kind and mt, so the loops unroll into registers. */
static inline __attribute__((always_inline)) void dot_float_tile(const float* x, int64_t K, const void* w,
                                                                 float* out, const int kind, const int mt) {
    __m512 acc[TILE][4];
    for (int m = 0; m < mt; m++)
        for (int u = 0; u < 4; u++) acc[m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        for (int u = 0; u < 4; u++) {
            __m512 wv = load16_weights(w, k + 16 * u, kind);
            for (int m = 0; m < mt; m++)
                acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k + 16 * u), acc[m][u]);
        }
    }
    for (int m = 0; m < mt; m++) {
        __m512 a = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
        float s = _mm512_reduce_add_ps(a);
        for (int64_t j = k; j < K; j++)
            s += (kind == W_INT8 ? (float)((const int8_t*)w)[j] : bf16_to_f32(((const uint16_t*)w)[j])) * x[m * K + j];
        out[m] = s;
    }
}

#ifdef __AVX512VNNI__
/* int8 weights . 16-bit activations (Q16) for nr weight rows (K apart) and mt activation
 * rows: per 128-column chunk and 32 columns, each weight row widened to 16 bits once and each
 * activation load shared by the nr weight rows; exact integer sums per lane, scaled per chunk
 * in float32. out[r * TILE + m]; a product's running sums go to state + r * INT8_STATE + 16 * m
 * between column ranges. pf (or NULL): nr rows (K apart) whose chunks c with
 * c % pf_every == pf_phase are asked from memory as the chunk is multiplied (see int8_segmented). */
#define INT8_SEGMENTS 16 /* lanes of a row's running sums between chunk ranges */
#define INT8_STATE (TILE * INT8_SEGMENTS)
#define INT8_PAIR 3      /* weight rows sharing each activation load, at most (registers: 3 x 4 x 2 + 4) */
#define INT8_BLOCK 48    /* weight rows a thread takes for every tile of activation rows in turn */
static inline __attribute__((always_inline)) void dot_int8_tile(const Q16* qx, int64_t m0, int64_t K,
                                                                const int8_t* w, float* out, int64_t c0,
                                                                int64_t c1, float* state, const int8_t* pf,
                                                                int64_t pf_every, int64_t pf_phase,
                                                                const int nr, const int mt) {
    const int64_t C = K / CHUNK;
    int64_t pf_next = first_prefetch(c0, pf_every, pf_phase);
    __m512 acc[INT8_PAIR][TILE];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mt; m++)
            acc[r][m] = c0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(state + r * INT8_STATE + 16 * m);
    for (int64_t c = c0; c < c1; c++) {
        prefetch_chunk(pf, K, c, pf_every, &pf_next, nr);
        __m512i ia[INT8_PAIR][TILE];
        for (int q = 0; q < 4; q++) {
            __m512i w16[INT8_PAIR];
            for (int r = 0; r < nr; r++)
                w16[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + r * K + c * CHUNK + 32 * q)));
            for (int m = 0; m < mt; m++) {
                __m512i xv = _mm512_loadu_si512(qx->q + (m0 + m) * K + c * CHUNK + 32 * q);
                if (nr > 1) __asm__("" : "+v"(xv)); /* one load for the nr rows, not one each */
                for (int r = 0; r < nr; r++)
                    ia[r][m] = q == 0 ? _mm512_madd_epi16(w16[r], xv) : _mm512_dpwssd_epi32(ia[r][m], w16[r], xv);
            }
        }
        for (int m = 0; m < mt; m++) {
            const __m512 sv = _mm512_set1_ps(qx->scale[(m0 + m) * C + c]);
            for (int r = 0; r < nr; r++) acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][m]), sv, acc[r][m]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mt; m++) {
            if (c1 == C)
                out[r * TILE + m] = _mm512_reduce_add_ps(acc[r][m]);
            else
                _mm512_storeu_ps(state + r * INT8_STATE + 16 * m, acc[r][m]);
        }
}
#endif

/* A chunk's 64 weight bytes at wc as their low nibbles (*lo) and high ones (*hi); the bytes
 * `ahead` on are asked from memory. */
static inline __attribute__((always_inline)) void load_nibbles(const uint8_t* wc, int64_t ahead, __m512i* lo,
                                                               __m512i* hi) {
    _mm_prefetch((const char*)(wc + ahead), WEIGHT_PREFETCH);
    const __m512i v = _mm512_loadu_si512(wc), nibble = _mm512_set1_epi8(0x0F);
    *lo = _mm512_and_si512(v, nibble), *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
}

/* A chunk's integer dot product, lane j: the nibbles lo (its first 64 columns) and hi (the
 * next 64) . the codes x[0..64) and x[64..128), four byte products per lane. */
static inline __attribute__((always_inline)) __m512i nibble_dot(__m512i lo, __m512i hi, const int8_t* x) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x)), hi,
                               _mm512_loadu_si512(x + CHUNK / 2));
#else /* pair sums below 2 * 15 * 127: two of them fit in int16 */
    const __m512i p = _mm512_add_epi16(_mm512_maddubs_epi16(lo, _mm512_loadu_si512(x)),
                                       _mm512_maddubs_epi16(hi, _mm512_loadu_si512(x + CHUNK / 2)));
    return _mm512_madd_epi16(p, _mm512_set1_epi16(1));
#endif
}

/* Integer parts of the int4 products (see int4_rows): out[r * mt + m] = sum over units u of
 * comb[(r * mt + m) * stride + u] * (codes of weight row r . xq of activation row m over the
 * `unit` columns of u), for nr weight rows (K / 2 bytes apart) and mt activation rows. Lane j
 * of a chunk's dot product covers columns 8j..8j+7, so it belongs to unit 8j / unit. With
 * several weight rows the activation loads are shared and their chains interleave. */
static inline __attribute__((always_inline)) void int4_tile(const int8_t* xq, int64_t K, const uint8_t* w,
                                                            const float* comb, int64_t stride, float* out,
                                                            const int unit, const int mt, const int nr) {
    const int64_t C = K / CHUNK;
    const int per_chunk = CHUNK / unit;
    const __m512i spread = unit == 64 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                      : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[2 * TILE];
    for (int i = 0; i < mt * nr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
        for (int r = 0; r < nr; r++) {
            __m512i lo, hi; /* chunk c of row r, and the same of two row blocks on asked from memory */
            load_nibbles(w + r * (K / 2) + c * (CHUNK / 2), 2 * nr * (K / 2), &lo, &hi);
            for (int m = 0; m < mt; m++) {
                const __m512i d = nibble_dot(lo, hi, xq + m * K + c * CHUNK);
                const float* s = comb + (r * mt + m) * stride + c * per_chunk;
                __m512 sv = unit == CHUNK ? _mm512_set1_ps(*s)
                                          : _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(s)));
                acc[r * mt + m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, acc[r * mt + m]);
            }
        }
    }
    for (int i = 0; i < mt * nr; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

/* The int4 products of int4_tile for weight groups of one chunk (gs = CHUNK), without comb:
 * per 16 chunks, the nr weight rows' scales and zeros (sc, zr: dt, C apart) and the mt activation
 * rows' steps and sums (qx, rows m0..) give each product's factors in a register (lane j: the
 * weight scale x the activation step of chunk s0 + j, taken for its chunk by a permute) and add
 * the zeros' part (zero - 8 scale) x sum lane by lane into the sums. A product's operations and
 * their order depend on neither mt nor nr. dt, mt and nr are constants where it is inlined. */
static inline __attribute__((always_inline)) void int4_tile_chunks(const QuantX* qx, int64_t m0, int64_t K,
                                                                   const uint8_t* w, const void* sc, const void* zr,
                                                                   float* out, const int dt, const int mt,
                                                                   const int nr) {
    const int64_t C = K / CHUNK;
    const int8_t* xq = qx->q + m0 * K;
    const __m512i one = _mm512_set1_epi32(1);
    __m512 acc[2 * TILE], f[2 * TILE];
    for (int i = 0; i < mt * nr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < C; s0 += 16) {
        const int64_t n = C - s0 < 16 ? C - s0 : 16;
        const __mmask16 k = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
        for (int r = 0; r < nr; r++) {
            const __m512 s = dt == BF16 ? bf16x16_to_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t*)sc + r * C + s0))
                                        : _mm512_maskz_loadu_ps(k, (const float*)sc + r * C + s0);
            const __m512 z = dt == BF16 ? bf16x16_to_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t*)zr + r * C + s0))
                                        : _mm512_maskz_loadu_ps(k, (const float*)zr + r * C + s0);
            const __m512 lo = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);
            for (int m = 0; m < mt; m++) {
                const float* xs = qx->scale + (m0 + m) * C + s0;
                acc[r * mt + m] = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(k, qx->sum + (m0 + m) * C + s0),
                                                  acc[r * mt + m]);
                f[r * mt + m] = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, xs));
            }
        }
        __m512i lane = _mm512_setzero_si512();
        for (int64_t c = s0; c < s0 + n; c++, lane = _mm512_add_epi32(lane, one)) {
            for (int r = 0; r < nr; r++) {
                __m512i lo, hi; /* chunk c of row r, and the same of two row blocks on asked from memory */
                load_nibbles(w + r * (K / 2) + c * (CHUNK / 2), 2 * nr * (K / 2), &lo, &hi);
                for (int m = 0; m < mt; m++) {
                    const __m512i d = nibble_dot(lo, hi, xq + m * K + c * CHUNK);
                    acc[r * mt + m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(lane, f[r * mt + m]),
                                                      acc[r * mt + m]);
                }
            }
        }
    }
    for (int i = 0; i < mt * nr; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#endif /* QVL_AVX512 */

/* ---- AVX2 row products ------------------------------------------------------------------------ */
#ifdef QVL_AVX2

static inline __m256 load8_weights(const void* w, int64_t k, const int kind) {
    if (kind == W_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)((const int8_t*)w + k))));
    return bf16x8_to_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)w + k)));
}

/* out[m] = sum_k w[k] * x[m][k] for mt <= TILE rows (float products), four accumulators per row. */
static inline __attribute__((always_inline)) void dot_float_tile(const float* x, int64_t K, const void* w,
                                                                 float* out, const int kind, const int mt) {
    __m256 acc[TILE][4];
    for (int m = 0; m < mt; m++)
        for (int u = 0; u < 4; u++) acc[m][u] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int u = 0; u < 4; u++) {
            __m256 wv = load8_weights(w, k + 8 * u, kind);
            for (int m = 0; m < mt; m++)
                acc[m][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k + 8 * u), acc[m][u]);
        }
    }
    for (int m = 0; m < mt; m++) {
        float s = hsum256(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
        for (int64_t j = k; j < K; j++)
            s += (kind == W_INT8 ? (float)((const int8_t*)w)[j] : bf16_to_f32(((const uint16_t*)w)[j])) * x[m * K + j];
        out[m] = s;
    }
}

static inline __m256i madd16(__m256i acc, __m256i a, __m256i b) { /* acc + pairwise int16 products */
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* ia[r][m] += 16-bit pair products of weight rows r (K bytes apart, widened here) and code rows
 * m < mt (ld bytes apart) over n steps of 16 columns, 2 weight rows and 1-4 activation rows:
 * vpmovsxbw, vpmaddwd and vpaddd in assembly, because GCC copies every accumulator once per
 * step in the C loop (8 register moves per 8 products: 4 rows 1.22x slower). */
#define ROW_STEP(addr, a, b)                                                                           \
    "vmovdqu " addr ", %%ymm14\n\t"                                                                    \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"                                                           \
    "vpaddd %%ymm15, %[" a "], %[" a "]\n\t"                                                           \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm14\n\t"                                                           \
    "vpaddd %%ymm14, %[" b "], %[" b "]\n\t"
#define PAIR_STEPS(rows)                                                                               \
    __asm__("1:\n\t"                                                                                   \
            "vpmovsxbw (%[w]), %%ymm12\n\t"                                                            \
            "vpmovsxbw (%[w], %[K]), %%ymm13\n\t" rows                                                 \
            "add $16, %[w]\n\t"                                                                        \
            "add $32, %[x]\n\t"                                                                        \
            "add $32, %[x3]\n\t"                                                                       \
            "dec %[n]\n\t"                                                                             \
            "jnz 1b"                                                                                   \
            : [a0] "+x"(ia[0][0]), [a1] "+x"(ia[0][1]), [a2] "+x"(ia[0][2]), [a3] "+x"(ia[0][3]),      \
              [b0] "+x"(ia[1][0]), [b1] "+x"(ia[1][1]), [b2] "+x"(ia[1][2]), [b3] "+x"(ia[1][3]),      \
              [w] "+r"(w), [x] "+r"(x), [x3] "+r"(x3), [n] "+r"(n)                                     \
            : [K] "r"(K), [ld] "r"(ld)                                                                 \
            : "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc")
static inline void int8_pair_steps(const int8_t* w, int64_t K, const int16_t* x, int64_t ld, int64_t n, __m256i ia[2][4],
                                   const int mt) {
    const int16_t* x3 = (const int16_t*)((const char*)x + 3 * ld);
    if (mt == 4)
        PAIR_STEPS(ROW_STEP("(%[x])", "a0", "b0") ROW_STEP("(%[x], %[ld])", "a1", "b1")
                       ROW_STEP("(%[x], %[ld], 2)", "a2", "b2") ROW_STEP("(%[x3])", "a3", "b3"));
    else if (mt == 3)
        PAIR_STEPS(ROW_STEP("(%[x])", "a0", "b0") ROW_STEP("(%[x], %[ld])", "a1", "b1")
                       ROW_STEP("(%[x], %[ld], 2)", "a2", "b2"));
    else if (mt == 2)
        PAIR_STEPS(ROW_STEP("(%[x])", "a0", "b0") ROW_STEP("(%[x], %[ld])", "a1", "b1"));
    else
        PAIR_STEPS(ROW_STEP("(%[x])", "a0", "b0"));
}
#undef PAIR_STEPS
#undef ROW_STEP

/* As the AVX-512 dot_int8_tile, in 16-column steps. */
#define INT8_SEGMENTS 8 /* lanes of a row's running sums between chunk ranges */
#define INT8_STATE (TILE * INT8_SEGMENTS)
#ifdef __AVXVNNI__ /* one vpdpwssd per product: pairs were 5-19% slower at 2-8 rows */
#define INT8_PAIR 1
#else /* vpmaddwd + vpaddd: weight rows sharing each activation load (the float sums spill) */
#define INT8_PAIR 2
#endif
#define INT8_BLOCK 32 /* weight rows a thread takes for every tile of activation rows in turn */
static inline __attribute__((always_inline)) void dot_int8_tile(const Q16* qx, int64_t m0, int64_t K,
                                                                const int8_t* w, float* out, int64_t c0,
                                                                int64_t c1, float* state, const int8_t* pf,
                                                                int64_t pf_every, int64_t pf_phase,
                                                                const int nr, const int mt) {
    const int64_t C = K / CHUNK;
    int64_t pf_next = first_prefetch(c0, pf_every, pf_phase);
    __m256 acc[INT8_PAIR][TILE];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mt; m++)
            acc[r][m] = c0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(state + r * INT8_STATE + 8 * m);
    for (int64_t c = c0; c < c1; c++) {
        prefetch_chunk(pf, K, c, pf_every, &pf_next, nr);
        __m256i ia[INT8_PAIR][TILE];
        for (int r = 0; r < INT8_PAIR; r++)
            for (int m = 0; m < TILE; m++) ia[r][m] = _mm256_setzero_si256();
#ifndef __AVXVNNI__
        if (nr == 2)
            int8_pair_steps(w + c * CHUNK, K, qx->q + m0 * K + c * CHUNK, K * 2, CHUNK / 16, ia, mt);
        else
#endif
        for (int j = 0; j < CHUNK; j += 16) {
            __m256i w16[INT8_PAIR];
            for (int r = 0; r < nr; r++)
                w16[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + r * K + c * CHUNK + j)));
            for (int m = 0; m < mt; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(qx->q + (m0 + m) * K + c * CHUNK + j));
                for (int r = 0; r < nr; r++) ia[r][m] = madd16(ia[r][m], w16[r], xv);
            }
        }
        for (int m = 0; m < mt; m++) {
            const __m256 sv = _mm256_set1_ps(qx->scale[(m0 + m) * C + c]);
            for (int r = 0; r < nr; r++) acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][m]), sv, acc[r][m]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mt; m++) {
            if (c1 == C)
                out[r * TILE + m] = hsum256(acc[r][m]);
            else
                _mm256_storeu_ps(state + r * INT8_STATE + 8 * m, acc[r][m]);
        }
}

/* Integer parts of the int4 products (see int4_rows), as the AVX-512 int4_tile: here the
 * dot products over weight bytes 32h..32h+31 of a chunk cover columns 64h..64h+63, lane j
 * columns 64h+8j..64h+8j+7 (unit (64h + 8j) / unit). Without VNNI the vpmaddubsw pair sums
 * (below 2 * 15 * 127) of a unit are added in int16 (four fit) before one vpmaddwd. */
static inline __attribute__((always_inline)) void int4_tile(const int8_t* xq, int64_t K, const uint8_t* w,
                                                            const float* comb, int64_t stride, float* out,
                                                            const int unit, const int mt, const int nr) {
    const int64_t C = K / CHUNK;
    const int per_chunk = CHUNK / unit;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i pick0 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), pick1 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    __m256 acc[2 * TILE], acc2[2 * TILE]; /* acc2: the second half-chunk's units, when they differ */
    for (int i = 0; i < mt * nr; i++) acc[i] = acc2[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
        for (int r = 0; r < nr; r++) {
            const uint8_t* wc = w + r * (K / 2) + c * (CHUNK / 2);
            _mm_prefetch((const char*)(wc + 2 * nr * (K / 2)), _MM_HINT_T0); /* two row blocks ahead */
            __m256i v0 = _mm256_loadu_si256((const __m256i*)wc), v1 = _mm256_loadu_si256((const __m256i*)(wc + 32));
            __m256i lo0 = _mm256_and_si256(v0, nibble), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
            __m256i lo1 = _mm256_and_si256(v1, nibble), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
            for (int m = 0; m < mt; m++) {
                const int8_t* x = xq + m * K + c * CHUNK;
                const __m256i x0 = _mm256_loadu_si256((const __m256i*)x),
                              x1 = _mm256_loadu_si256((const __m256i*)(x + 32)),
                              x2 = _mm256_loadu_si256((const __m256i*)(x + 64)),
                              x3 = _mm256_loadu_si256((const __m256i*)(x + 96));
                const float* s = comb + (r * mt + m) * stride + c * per_chunk;
                const int i = r * mt + m;
#ifdef __AVXVNNI__
                __m256i d0 = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo0, x0);
                d0 = _mm256_dpbusd_avx_epi32(d0, hi0, x2);
                __m256i d1 = unit == CHUNK ? d0 : _mm256_setzero_si256();
                d1 = _mm256_dpbusd_avx_epi32(d1, lo1, x1);
                d1 = _mm256_dpbusd_avx_epi32(d1, hi1, x3);
                if (unit == CHUNK) {
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_broadcast_ss(s), acc[i]);
                    continue;
                }
#else
                const __m256i ones = _mm256_set1_epi16(1);
                __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x0), _mm256_maddubs_epi16(hi0, x2));
                __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, x1), _mm256_maddubs_epi16(hi1, x3));
                if (unit == CHUNK) {
                    __m256i d = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(s), acc[i]);
                    continue;
                }
                __m256i d0 = _mm256_madd_epi16(p0, ones), d1 = _mm256_madd_epi16(p1, ones);
#endif
                __m256 s0, s1;
                if (unit == 64) {
                    s0 = _mm256_broadcast_ss(s), s1 = _mm256_broadcast_ss(s + 1);
                } else { /* 32: lanes 0-3 and 4-7 of each half belong to consecutive units */
                    __m256 four = _mm256_castps128_ps256(_mm_loadu_ps(s));
                    s0 = _mm256_permutevar8x32_ps(four, pick0), s1 = _mm256_permutevar8x32_ps(four, pick1);
                }
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), s0, acc[i]);
                acc2[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), s1, acc2[i]);
            }
        }
    }
    for (int i = 0; i < mt * nr; i++) out[i] = hsum256(_mm256_add_ps(acc[i], acc2[i]));
}
#endif /* QVL_AVX2 */

/* ---- NEON row products ------------------------------------------------------------------------ */
#ifdef QVL_NEON

static inline float32x4_t load4_weights(const void* w, int64_t k, const int kind) {
    if (kind == W_INT8) {
        int16x4_t h = vget_low_s16(vmovl_s8(vld1_s8((const int8_t*)w + k)));
        return vcvtq_f32_s32(vmovl_s16(h));
    }
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t*)w + k), 16));
}

static inline __attribute__((always_inline)) void dot_float_tile(const float* x, int64_t K, const void* w,
                                                                 float* out, const int kind, const int mt) {
    float32x4_t acc[TILE][4];
    for (int m = 0; m < mt; m++)
        for (int u = 0; u < 4; u++) acc[m][u] = vdupq_n_f32(0.f);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        for (int u = 0; u < 4; u++) {
            float32x4_t wv = load4_weights(w, k + 4 * u, kind);
            for (int m = 0; m < mt; m++) acc[m][u] = vfmaq_f32(acc[m][u], wv, vld1q_f32(x + m * K + k + 4 * u));
        }
    }
    for (int m = 0; m < mt; m++) {
        float s = vaddvq_f32(vaddq_f32(vaddq_f32(acc[m][0], acc[m][1]), vaddq_f32(acc[m][2], acc[m][3])));
        for (int64_t j = k; j < K; j++)
            s += (kind == W_INT8 ? (float)((const int8_t*)w)[j] : bf16_to_f32(((const uint16_t*)w)[j])) * x[m * K + j];
        out[m] = s;
    }
}

static inline __attribute__((always_inline)) void dot_int8_tile(const Q16* qx, int64_t m0, int64_t K,
                                                                const int8_t* w, float* out, const int mt) {
    const int64_t C = K / CHUNK;
    float32x4_t acc[TILE];
    for (int m = 0; m < mt; m++) acc[m] = vdupq_n_f32(0.f);
    for (int64_t c = 0; c < C; c++) {
        int32x4_t ia[TILE];
        for (int m = 0; m < mt; m++) ia[m] = vdupq_n_s32(0);
        for (int j = 0; j < CHUNK; j += 16) {
            int8x16_t wv = vld1q_s8(w + c * CHUNK + j);
            int16x8_t wl = vmovl_s8(vget_low_s8(wv)), wh = vmovl_high_s8(wv);
            for (int m = 0; m < mt; m++) {
                const int16_t* xr = qx->q + (m0 + m) * K + c * CHUNK + j;
                int16x8_t xl = vld1q_s16(xr), xh = vld1q_s16(xr + 8);
                ia[m] = vmlal_s16(ia[m], vget_low_s16(wl), vget_low_s16(xl));
                ia[m] = vmlal_high_s16(ia[m], wl, xl);
                ia[m] = vmlal_s16(ia[m], vget_low_s16(wh), vget_low_s16(xh));
                ia[m] = vmlal_high_s16(ia[m], wh, xh);
            }
        }
        for (int m = 0; m < mt; m++) acc[m] = vfmaq_n_f32(acc[m], vcvtq_f32_s32(ia[m]), qx->scale[(m0 + m) * C + c]);
    }
    for (int m = 0; m < mt; m++) out[m] = vaddvq_f32(acc[m]);
}

#ifdef __ARM_FEATURE_DOTPROD
/* Byte quarter i (16 bytes) of a chunk covers columns 32i..32i+31 (low nibbles with xq[16i..],
 * high with xq[64+16i..]): with groups of >= 32 columns, one weight scale per quarter. */
static inline __attribute__((always_inline)) void dot_int4_tile(const QuantX* qx, int64_t m0, int64_t K, int64_t gs,
                                                                const uint8_t* w, const void* sc, const void* zr,
                                                                int dt, float* out, const int mt) {
    const int64_t C = K / CHUNK, G = K / gs;
    float32x4_t acc[TILE];
    for (int m = 0; m < mt; m++) acc[m] = vdupq_n_f32(0.f);
    for (int64_t c = 0; c < C; c++) {
        float quarter_scale[4];
        for (int i = 0; i < 4; i++) quarter_scale[i] = get(sc, dt, (c * CHUNK + 32 * i) / gs);
        uint8x16_t lo[4], hi[4];
        for (int i = 0; i < 4; i++) {
            uint8x16_t v = vld1q_u8(w + c * (CHUNK / 2) + 16 * i);
            lo[i] = vandq_u8(v, vdupq_n_u8(0x0F));
            hi[i] = vshrq_n_u8(v, 4);
        }
        for (int m = 0; m < mt; m++) {
            const int8_t* xq = qx->q + (m0 + m) * K + c * CHUNK;
            const float xs = qx->scale[(m0 + m) * C + c];
            for (int i = 0; i < 4; i++) {
                int32x4_t d = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(lo[i]), vld1q_s8(xq + 16 * i));
                d = vdotq_s32(d, vreinterpretq_s8_u8(hi[i]), vld1q_s8(xq + 64 + 16 * i));
                acc[m] = vfmaq_n_f32(acc[m], vcvtq_f32_s32(d), quarter_scale[i] * xs);
            }
        }
    }
    for (int m = 0; m < mt; m++) {
        const float* xs = qx->sum + (m0 + m) * G;
        float off = 0.f;
        for (int64_t g = 0; g < G; g++) off += (get(zr, dt, g) - 8.f * get(sc, dt, g)) * xs[g];
        out[m] = vaddvq_f32(acc[m]) + off;
    }
}
#define QVL_NEON_INT4 1
#endif
#endif /* QVL_NEON */

/* ---- int4 weights on x86: four weight rows per pass ----------------------------------------- */
#if defined(QVL_AVX512) || defined(QVL_AVX2)
#define INT4_ROWS 4 /* weight rows sharing one pass over an activation row (decoding: M = 1) */

static inline __m256 load8_dt(const void* p, const int dt, int64_t i) { /* 8 float32 or bf16 values as float32 */
    if (dt == BF16) return bf16x8_to_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i)));
    return _mm256_loadu_ps((const float*)p + i);
}

/* For one weight row (its scales sc and zeros zr over K / gs groups) and activation row m:
 * comb[u] = weight scale x activation scale of each unit of min(gs, 128) columns (what one
 * integer dot product of int4_tile spans), and the returned zero term
 * sum_g (zero_g - 8 scale_g) * sum(x over group g). dt is a constant where it is inlined. */
static inline __attribute__((always_inline)) float int4_prep_dt(const QuantX* qx, int64_t m, int64_t K, int64_t gs,
                                                                const void* sc, const void* zr, float* comb,
                                                                const int dt) {
    const int64_t G = K / gs, C = K / CHUNK;
    const float *xsum = qx->sum + m * G, *xs = qx->scale + m * C;
    const float* xu = gs < CHUNK ? qx->unit + m * G : xs; /* per group, when groups are units */
    __m256 off = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        __m256 s = load8_dt(sc, dt, g), z = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, load8_dt(zr, dt, g));
        off = _mm256_fmadd_ps(z, _mm256_loadu_ps(xsum + g), off);
        if (gs <= CHUNK) _mm256_storeu_ps(comb + g, _mm256_mul_ps(s, _mm256_loadu_ps(xu + g)));
    }
    float rest = 0.f;
    for (; g < G; g++) {
        rest += (get(zr, dt, g) - 8.f * get(sc, dt, g)) * xsum[g];
        if (gs <= CHUNK) comb[g] = get(sc, dt, g) * xu[g];
    }
    if (gs > CHUNK)
        for (int64_t c = 0; c < C; c++) comb[c] = get(sc, dt, c / (gs / CHUNK)) * xs[c];
    return hsum256(off) + rest;
}

static float int4_prep(const QuantX* qx, int64_t m, int64_t K, int64_t gs, const void* sc, const void* zr, int dt,
                       float* comb) {
    return dt == BF16 ? int4_prep_dt(qx, m, K, gs, sc, zr, comb, BF16) : int4_prep_dt(qx, m, K, gs, sc, zr, comb, F32);
}

/* Call F(..., c, mt, nr) with c, mt and nr compile-time constants (mt > 1 only with nr <= 2). */
#define INT4_SHAPES(F, c, ...)                                                           \
    switch (mt * 8 + nr) {                                                               \
        case 8 + 4: F(__VA_ARGS__, c, 1, 4); break;                                      \
        case 8 + 3: F(__VA_ARGS__, c, 1, 3); break;                                      \
        case 8 + 2: F(__VA_ARGS__, c, 1, 2); break;                                      \
        case 16 + 2: F(__VA_ARGS__, c, 2, 2); break;                                     \
        case 24 + 2: F(__VA_ARGS__, c, 3, 2); break;                                     \
        case 32 + 2: F(__VA_ARGS__, c, 4, 2); break;                                     \
        case 16 + 1: F(__VA_ARGS__, c, 2, 1); break;                                     \
        case 24 + 1: F(__VA_ARGS__, c, 3, 1); break;                                     \
        case 32 + 1: F(__VA_ARGS__, c, 4, 1); break;                                     \
        default: F(__VA_ARGS__, c, 1, 1); break;                                         \
    }

static void int4_tiles(const int8_t* xq, int64_t K, const uint8_t* w, const float* comb, int64_t stride, float* out,
                       int64_t unit, int mt, int nr) {
    if (unit == 32) {
        INT4_SHAPES(int4_tile, 32, xq, K, w, comb, stride, out)
    } else if (unit == 64) {
        INT4_SHAPES(int4_tile, 64, xq, K, w, comb, stride, out)
    } else {
        INT4_SHAPES(int4_tile, CHUNK, xq, K, w, comb, stride, out)
    }
}

#ifdef QVL_AVX512
static void int4_chunk_tiles(const QuantX* qx, int64_t m0, int64_t K, const uint8_t* w, const void* sc,
                             const void* zr, float* out, int dt, int mt, int nr) {
    if (dt == BF16) {
        INT4_SHAPES(int4_tile_chunks, BF16, qx, m0, K, w, sc, zr, out)
    } else {
        INT4_SHAPES(int4_tile_chunks, F32, qx, m0, K, w, sc, zr, out)
    }
}
#endif

/* int4 weight rows n0..n0+nr-1 (nr <= INT4_ROWS) . every activation row: out[r * M + m]. One
 * activation row (decoding) takes the rows together; more take them one by one, in tiles of
 * TILE activation rows, or on AVX-512 from TILE + 1 rows on two at a time (each activation
 * load serving both: 8 rows 0.89x the time; with one tile pairs were slower, 4 rows 1.04x and
 * 2 rows 1.23x, the pass being memory-bound there). On AVX-512, groups of one chunk (qvl's
 * own int4) take int4_tile_chunks, the factors made in registers instead of int4_prep's pass
 * through comb (docs/decisions/decode-step.md). */
static void int4_rows(const QuantX* qx, int64_t M, int64_t K, int64_t gs, const uint8_t* w, const void* sc,
                      const void* zr, int dt, int64_t n0, int nr, float* out) {
    const int64_t G = K / gs, unit = gs < CHUNK ? gs : CHUNK, stride = K / unit + 4; /* 4: _mm_loadu_ps past the end */
    const size_t es = dt == BF16 ? 2 : 4;
#ifdef QVL_AVX512
    for (int64_t b = 0; b < (int64_t)(nr * G * es); b += 64) { /* the scales and zeros of two blocks on */
        _mm_prefetch((const char*)sc + (n0 + 2 * INT4_ROWS) * G * es + b, WEIGHT_PREFETCH);
        _mm_prefetch((const char*)zr + (n0 + 2 * INT4_ROWS) * G * es + b, WEIGHT_PREFETCH);
    }
#endif
    enum { MOST = INT4_ROWS > 2 * TILE ? INT4_ROWS : 2 * TILE }; /* products per int4_tile call */
    float comb[MOST * stride], off[MOST], part[MOST];
#ifdef QVL_AVX512
    const int in_registers = gs == CHUNK; /* int4_tile_chunks: no comb */
    const int rows = M == 1 ? nr : M > TILE && nr >= 2 ? 2 : 1;
#else /* 16 vector registers: no room for pairs' sums, nor for the factors */
    const int rows = M == 1 ? nr : 1;
#endif
    for (int64_t r0 = 0; r0 < nr; r0 += rows) {
        const int rr = nr - r0 < rows ? (int)(nr - r0) : rows;
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int mt = M - m0 < TILE ? (int)(M - m0) : TILE;
#ifdef QVL_AVX512
            if (in_registers) {
                const int64_t n = n0 + r0;
                int4_chunk_tiles(qx, m0, K, w + n * (K / 2), (const char*)sc + n * G * es, (const char*)zr + n * G * es,
                                 part, dt, mt, rr);
                for (int r = 0; r < rr; r++)
                    for (int m = 0; m < mt; m++) out[(r0 + r) * M + m0 + m] = part[r * mt + m];
                continue;
            }
#endif
            for (int r = 0; r < rr; r++)
                for (int m = 0; m < mt; m++) {
                    const int64_t n = n0 + r0 + r;
                    off[r * mt + m] = int4_prep(qx, m0 + m, K, gs, (const char*)sc + n * G * es,
                                                (const char*)zr + n * G * es, dt, comb + (r * mt + m) * stride);
                }
            int4_tiles(qx->q + m0 * K, K, w + (n0 + r0) * (K / 2), comb, stride, part, unit, mt, rr);
            for (int r = 0; r < rr; r++)
                for (int m = 0; m < mt; m++) out[(r0 + r) * M + m0 + m] = part[r * mt + m] + off[r * mt + m];
        }
    }
}
#endif

/* ---- choosing the row product ----------------------------------------------------------------- */

/* Call F(..., mt) with mt a compile-time constant, so the always-inline tiles unroll. */
#define TILED(mt, F, ...)                      \
    switch (mt) {                              \
        case 4: F(__VA_ARGS__, 4); return;     \
        case 3: F(__VA_ARGS__, 3); return;     \
        case 2: F(__VA_ARGS__, 2); return;     \
        default: F(__VA_ARGS__, 1); return;    \
    }

#define GEMV_BLOCK 32 /* weight rows of one item of the float products, for every tile of activation rows in turn */

/* out[m] = row n of W . x[m0 + m] for the rows of one tile. */
static void row_products(int kind, const GemvInput* a, int forms, int64_t m0, int64_t mt, int64_t K, int64_t gs,
                         const void* w, const void* sc, const void* zr, int dt, int64_t n, float* out) {
    const int64_t G = kind == W_INT4 ? K / gs : 0;
    const size_t esize = dt == BF16 ? 2 : 4;
    const void* wrow = kind == W_INT4   ? (const void*)((const uint8_t*)w + n * (K / 2))
                       : kind == W_INT8 ? (const void*)((const int8_t*)w + n * K)
                                        : (const void*)((const uint16_t*)w + n * K);
    const void* srow = kind == W_INT4 ? (const char*)sc + n * G * esize : NULL;
    const void* zrow = kind == W_INT4 ? (const char*)zr + n * G * esize : NULL;
    if (kind == W_INT4 && (forms & FORM_Q8)) { /* x86 takes int4_rows instead */
#if defined(QVL_NEON_INT4)
        TILED(mt, dot_int4_tile, &a->q8, m0, K, gs, wrow, srow, zrow, dt, out)
#else
        for (int64_t m = 0; m < mt; m++) out[m] = dot_int4_q8(&a->q8, m0 + m, K, gs, wrow, srow, zrow, dt);
        return;
#endif
    }
    if (kind == W_INT8 && (forms & FORM_Q16)) {
#if defined(QVL_NEON) /* x86 with integer pair products takes int8_rows instead */
        TILED(mt, dot_int8_tile, &a->q16, m0, K, wrow, out)
#else
        for (int64_t m = 0; m < mt; m++) out[m] = dot_int8_q16(&a->q16, m0 + m, K, wrow);
        return;
#endif
    }
#if defined(QVL_AVX512) || defined(QVL_AVX2) || defined(QVL_NEON)
    if (kind == W_INT8) TILED(mt, dot_float_tile, a->xf + m0 * K, K, wrow, out, W_INT8)
    if (kind == W_BF16) TILED(mt, dot_float_tile, a->xf + m0 * K, K, wrow, out, W_BF16)
#endif
    for (int64_t m = 0; m < mt; m++) {
        const float* xr = a->xf + (m0 + m) * K;
        out[m] = kind == W_INT4   ? dot_int4_float(xr, wrow, srow, zrow, dt, K, gs)
                 : kind == W_INT8 ? dot_int8_float(xr, wrow, K)
                                  : dot_bf16(xr, wrow, K);
    }
}

/* own[(n - first) * M + m] = row n of W . x[m] for the weight rows of one block. */
static void rows_block(const GemvProduct* p, int64_t first, int64_t last, float* own, const TeamItem* it) {
    const QvlLinear* l = &p->l;
    const int64_t M = p->in->M;
    float out[TILE];
    for (int64_t m0 = 0; m0 < M; m0 += TILE) {
        const int64_t mt = M - m0 < TILE ? M - m0 : TILE;
        for (int64_t n = first; n < last; n++) {
            if (team_item_dropped(it)) return;
            row_products((int)l->kind, p->in, p->forms, m0, mt, l->k, l->group_size, l->w, l->scale, l->zero, p->dt, n,
                         out);
            for (int64_t m = 0; m < mt; m++) own[(n - first) * M + m0 + m] = out[m];
        }
    }
}

#ifdef INT8_SEGMENTS
static void int8_segment_tile(const Q16* qx, int64_t m0, int64_t mt, int64_t K, const int8_t* w, float* out,
                              int64_t c0, int64_t c1, float* state, const int8_t* pf, int64_t pf_every,
                              int64_t pf_phase, int nr) {
#if INT8_PAIR >= 3
    if (nr == 3) TILED(mt, dot_int8_tile, qx, m0, K, w, out, c0, c1, state, pf, pf_every, pf_phase, 3)
#endif
#if INT8_PAIR >= 2
    if (nr == 2) TILED(mt, dot_int8_tile, qx, m0, K, w, out, c0, c1, state, pf, pf_every, pf_phase, 2)
#endif
    TILED(mt, dot_int8_tile, qx, m0, K, w, out, c0, c1, state, pf, pf_every, pf_phase, 1)
}

/* The int8 products of one block of weight rows first..last-1 (x86) into own[(n - first) * M + m]:
 * for each tile of activation rows, the columns in ranges whose codes fit L1, every weight row of
 * the block taking the range before the next one. A product's running sums carry over between
 * ranges in `state`, so it is computed exactly as in one pass (the same sums in the same order,
 * whatever M, K, the tile, the block or the thread). From 2 activation rows on, weight rows go up
 * to INT8_PAIR at a time (each activation load serves them all; on AVX-512, three rows to a tile
 * of 3-4 activation rows: 8 rows 0.84x the time of pairs, the loads per product being the limit).
 * As a block's chunks are multiplied, the same chunks of the thread's next block (next_first..
 * next_last-1, claimed already: TeamItem.next) are asked from memory, each tile of activation rows
 * asking for every tiles-th chunk: the next block streams in under the products rather than after
 * them (4 rows: the decode step from 1.6x to 1.2x one row's; asked in a burst per row, it did not
 * overlap; one row: 0.97x without the prefetch). One row alone streams its weights faster without
 * pairs. */
static void int8_rows(const GemvProduct* p, int64_t first, int64_t last, int64_t next_first, int64_t next_last,
                      float* own, const TeamItem* it) {
    const Q16* qx = &p->in->q16;
    const int8_t* w = (const int8_t*)p->l.w;
    const int64_t M = p->in->M, K = p->l.k, C = K / CHUNK, tiles = (M + TILE - 1) / TILE;
    float state[INT8_BLOCK * INT8_STATE], out[INT8_PAIR * TILE];
    for (int64_t m0 = 0; m0 < M; m0 += TILE) {
        const int64_t mt = M - m0 < TILE ? M - m0 : TILE;
        /* one row streams its weights faster alone; a tile of 1-2 rows takes pairs (Zen 5, 2 rows:
         * triples 1.2x slower in the fast memory mode) */
        const int64_t pair = M == 1 ? 1 : mt <= 2 && INT8_PAIR > 2 ? 2 : INT8_PAIR;
        /* all columns while the tile's codes take up to 24 KB, else ranges of 16 KB of them (measured
         * on a Zen 5: whole rows stream from memory faster; split, 8 rows at K = 6144 took 23 ms
         * instead of 33) */
        const int64_t range = mt * K * 2 <= 24576 ? C : 16384 / (mt * CHUNK * 2);
        for (int64_t c0 = 0; c0 < C; c0 += range) {
            const int64_t c1 = c0 + range < C ? c0 + range : C;
            for (int64_t n = first; n < last; n += pair) {
                if (team_item_dropped(it)) return;
                const int nr = last - n < pair ? (int)(last - n) : (int)pair;
                const int64_t pn = next_first + (n - first); /* the same rows of the next block */
                const int8_t* pf = next_first >= 0 && pn + nr <= next_last ? w + pn * K : NULL;
                int8_segment_tile(qx, m0, mt, K, w + n * K, out, c0, c1, state + (n - first) * INT8_STATE, pf, tiles,
                                  m0 / TILE, nr);
                if (c1 < C) continue;
                for (int r = 0; r < nr; r++)
                    for (int64_t m = 0; m < mt; m++) own[(n - first + r) * M + m0 + m] = out[r * TILE + m];
            }
        }
    }
}
#endif

/* ---- the products as team items ------------------------------------------------------------------ */

enum { PATH_ROWS, PATH_INT8, PATH_INT4 }; /* row_products, int8_rows, int4_rows (beside AMX blocks) */

/* The activation forms the linear l's products read for M rows: FORM_Q16 for int8 weights over
 * whole chunks (FORM_AMX too where the tiles take them), FORM_Q8 for int4 weights whose groups
 * the integer path takes. */
int qvl_gemv_forms(const QvlLinear* l, int64_t M) {
    if (l->k % CHUNK) return 0;
    if (l->kind == W_INT8) return FORM_Q16 | (l->n >= 16 && qvl_amx_codes_bytes(M, l->k) > 0 ? FORM_AMX : 0);
    const int64_t gs = l->group_size;
    return l->kind == W_INT4 && (gs == 32 || gs == 64 || gs % CHUNK == 0) ? FORM_Q8 : 0;
}

static inline int64_t aligned64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* Bytes of an input of up to M rows of K columns in every form (int4 groups of 32 columns or more). */
int64_t qvl_gemv_input_bytes(int64_t M, int64_t K) {
    const int64_t C = K / CHUNK, G = K / 32;
    return 64 + aligned64(M * K * 4) + aligned64(M * K * 2) + aligned64(M * C * 4) +
           aligned64(qvl_amx_codes_bytes(M, K)) + aligned64(M * K) + aligned64(M * C * 4) + 2 * aligned64(M * G * 4);
}

/* The buffers of an input of up to M rows of K columns, laid out in mem (qvl_gemv_input_bytes). */
void qvl_gemv_input(GemvInput* in, int64_t M, int64_t K, char* mem) {
    const int64_t C = K / CHUNK, G = K / 32;
    char* at = (char*)aligned64((int64_t)(uintptr_t)mem);
#define CARVE(type, bytes) (type)(at += aligned64(bytes), at - aligned64(bytes))
    *in = (GemvInput){M, K, 0, CARVE(float*, M * K * 4)};
    in->q16 = (Q16){CARVE(int16_t*, M * K * 2), CARVE(float*, M * C * 4)};
    in->amx.rep = CARVE(float*, qvl_amx_codes_bytes(M, K)); /* qvl_amx_codes lays it out */
    in->q8 = (QuantX){CARVE(int8_t*, M * K), CARVE(float*, M * C * 4), CARVE(float*, M * G * 4),
                      CARVE(float*, M * G * 4)};
#undef CARVE
}

/* x [M][K] (dt; M up to the rows it was laid out for) in the given forms. */
void qvl_gemv_prepare(GemvInput* in, int forms, const void* x, int dt, int64_t M, int64_t gs, int threads) {
    const int64_t K = in->K;
    in->M = M, in->gs = gs;
    if (dt == BF16) {
#pragma omp parallel for simd num_threads(M >= 32 ? threads : 1) schedule(dynamic, 4096)
        for (int64_t i = 0; i < M * K; i++) in->xf[i] = bf16_to_f32(((const uint16_t*)x)[i]);
    } else {
        memcpy(in->xf, x, (size_t)(M * K) * sizeof(float));
    }
    if (forms & FORM_Q16) quantize16(in->xf, M, K, &in->q16, threads);
    if (forms & FORM_AMX) qvl_amx_codes(in->q16.q, in->q16.scale, M, K, (char*)in->amx.rep, &in->amx);
    if (forms & FORM_Q8) quantize_activations(in->xf, M, K, gs, &in->q8);
}

/* Rows per block for `rows` rows split among `threads`: an equal share rounded up to `unit`
 * rows, at most `most`. */
static int64_t block_rows(int64_t rows, int threads, int64_t unit, int64_t most) {
    const int64_t share = ((rows + threads - 1) / threads + unit - 1) / unit * unit;
    return share < most ? share : most;
}

void qvl_gemv_product(GemvProduct* p, const QvlLinear* l, const GemvInput* in, int forms, int dt, void* y,
                      int threads) {
    const int T = threads < 1 ? 1 : threads;
    forms &= qvl_gemv_forms(l, in->M); /* what the input has and this product reads */
    *p = (GemvProduct){*l, in, dt, forms, PATH_ROWS, y};
    int64_t unit = 1, most = GEMV_BLOCK;
#if defined(QVL_AVX512) || defined(QVL_AVX2)
    if (forms & FORM_Q8) p->path = PATH_INT4, unit = INT4_ROWS, most = 12 * INT4_ROWS;
#endif
    if (forms & FORM_Q16) {
        if (forms & FORM_AMX) p->amx_blocks = l->n / 16, p->first_row = l->n - l->n % 16;
#ifdef INT8_SEGMENTS
        p->path = PATH_INT8, unit = INT8_PAIR, most = INT8_BLOCK;
#endif
    }
    const int64_t rows = l->n - p->first_row;
    p->block_rows = rows > 0 ? block_rows(rows, T, unit, most) : 1;
    p->items = p->amx_blocks + (rows + p->block_rows - 1) / p->block_rows;
}

int64_t qvl_gemv_own_floats(const GemvProduct* p) {
    const int64_t rows = p->block_rows * p->in->M, amx = p->amx_blocks ? (p->in->M + 15) / 16 * 256 : 0;
    return rows > amx ? rows : amx;
}

/* Item i of product p (its weight rows' products into it->own); next: the thread's next item of
 * the same product (-1: none), whose weights are asked from memory meanwhile. */
static void gemv_item(const GemvProduct* p, int64_t i, int64_t next, const TeamItem* it) {
    if (i < p->amx_blocks) {
        qvl_amx_block(&p->in->amx, (const int8_t*)p->l.w, i, it->own);
        return;
    }
    const int64_t first = p->first_row + (i - p->amx_blocks) * p->block_rows;
    const int64_t last = first + p->block_rows < p->l.n ? first + p->block_rows : p->l.n;
#if defined(QVL_AVX512) || defined(QVL_AVX2)
    if (p->path == PATH_INT4) {
        for (int64_t n0 = first; n0 < last; n0 += INT4_ROWS) {
            if (team_item_dropped(it)) return;
            const int nr = last - n0 < INT4_ROWS ? (int)(last - n0) : INT4_ROWS;
            int4_rows(&p->in->q8, p->in->M, p->l.k, p->l.group_size, (const uint8_t*)p->l.w, p->l.scale, p->l.zero,
                      p->dt, n0, nr, it->own + (n0 - first) * p->in->M);
        }
        return;
    }
#endif
#ifdef INT8_SEGMENTS
    if (p->path == PATH_INT8) {
        const int64_t nf = next >= 0 && next >= p->amx_blocks ? p->first_row + (next - p->amx_blocks) * p->block_rows
                                                              : -1;
        int8_rows(p, first, last, nf, nf + p->block_rows < p->l.n ? nf + p->block_rows : p->l.n, it->own, it);
        return;
    }
#endif
    (void)next;
    rows_block(p, first, last, it->own, it);
}

/* y[m][n] = own[(n - first) * M + m] (x scale[n] where given, + bias[n] where given), rounded to
 * dt, for rows first..last of every activation row m; dt a constant where inlined, the rows
 * vectorise. */
static inline __attribute__((always_inline)) void commit_rows(const float* own, int64_t M, int64_t N, int64_t first,
                                                               int64_t last, const void* scale, const void* bias,
                                                               void* y, const int dt) {
    for (int64_t m = 0; m < M; m++) {
#pragma omp simd
        for (int64_t n = first; n < last; n++) {
            float v = own[(n - first) * M + m];
            if (scale) v *= get(scale, dt, n);
            if (bias) v += get(bias, dt, n);
            if (dt == BF16)
                ((uint16_t*)y)[m * N + n] = f32_to_bf16(v);
            else
                ((float*)y)[m * N + n] = v;
        }
    }
}

/* Item i's results from it->own into y: times the int8 weights' row scales, plus the bias. */
static void gemv_commit(const GemvProduct* p, int64_t i, const TeamItem* it) {
    const QvlLinear* l = &p->l;
    if (i < p->amx_blocks) {
        qvl_amx_write(&p->in->amx, it->own, l->scale, l->bias, p->dt, i, l->n, p->y);
        return;
    }
    const int64_t M = p->in->M, N = l->n, first = p->first_row + (i - p->amx_blocks) * p->block_rows;
    const int64_t last = first + p->block_rows < N ? first + p->block_rows : N;
    if (p->dt == BF16)
        commit_rows(it->own, M, N, first, last, l->kind == W_INT8 ? l->scale : NULL, l->bias, p->y, BF16);
    else
        commit_rows(it->own, M, N, first, last, l->kind == W_INT8 ? l->scale : NULL, l->bias, p->y, F32);
}

/* The product holding job item `index` (its index within that product in *local). */
static const GemvProduct* locate(const GemvJob* j, int64_t index, int64_t* local) {
    int64_t lo = 0, hi = j->n - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (j->first[mid] <= index)
            lo = mid;
        else
            hi = mid - 1;
    }
    *local = index - j->first[lo];
    return &j->p[lo];
}

static int gemv_run(const void* ctx, const TeamItem* it) {
    const GemvJob* j = (const GemvJob*)ctx;
    int64_t i, next = -1;
    const GemvProduct* p = locate(j, it->index, &i);
    if (it->next >= 0 && it->next - it->index == 1 && i + 1 < p->items) next = i + 1;
    gemv_item(p, i, next, it);
    return 0;
}

static void gemv_write(const void* ctx, const TeamItem* it) {
    int64_t i;
    const GemvProduct* p = locate((const GemvJob*)ctx, it->index, &i);
    gemv_commit(p, i, it);
}

TeamJob qvl_gemv_job(const GemvJob* job) { return (TeamJob){job->first[job->n], 1, gemv_run, gemv_write, job}; }

/* y[M][N] = x[M][K] . W^T (+ bias), W in one of the layouts above. Returns 0, or -1 when
 * out of memory. */
int qvl_linear(int kind, const void* x, int dt, int64_t M, int64_t K, int64_t N, const void* w, const void* scale,
               const void* zero, int64_t gs, const void* bias, void* y, int threads) {
    const QvlLinear l = {kind, N, K, gs, w, scale, zero, bias};
    const int forms = qvl_gemv_forms(&l, M);
    char* mem = malloc((size_t)qvl_gemv_input_bytes(M, K));
    if (!mem) return -1;
    GemvInput in;
    qvl_gemv_input(&in, M, K, mem);
    qvl_gemv_prepare(&in, forms, x, dt, M, gs, threads);
    GemvProduct p;
    qvl_gemv_product(&p, &l, &in, forms, dt, y, threads);
    const int64_t first[2] = {0, p.items};
    const GemvJob products = {1, &p, first};
    const TeamJob job = qvl_gemv_job(&products);
    const int status = team_region(threads, p.items, qvl_gemv_own_floats(&p), team_one_job, &job, NULL);
    free(mem);
    return status ? -1 : 0;
}

/* o[K] (dtype dt) = row[K] * s: one int8 weight row dequantised (bf16 rounded to nearest even,
 * as torch rounds; in hardware where the CPU has AVX512-BF16). */
static void dequantize_int8_row(const int8_t* row, float s, int dt, void* o, int64_t K) {
    int64_t k = 0;
#if defined(QVL_AVX512)
    const __m512 vs = _mm512_set1_ps(s);
#define QVL_I8X16_PS(p) _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p)))), vs)
    if (dt == BF16) {
#ifdef __AVX512BF16__
        for (; k + 32 <= K; k += 32)
            _mm512_storeu_si512((uint16_t*)o + k, (__m512i)_mm512_cvtne2ps_pbh(QVL_I8X16_PS(row + k + 16),
                                                                                QVL_I8X16_PS(row + k)));
#endif
    } else {
        for (; k + 16 <= K; k += 16) _mm512_storeu_ps((float*)o + k, QVL_I8X16_PS(row + k));
    }
#undef QVL_I8X16_PS
#elif defined(QVL_AVX2)
    if (dt != BF16) {
        const __m256 vs = _mm256_set1_ps(s);
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps((float*)o + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                              _mm_loadl_epi64((const __m128i*)(row + k)))), vs));
    }
#endif
    if (dt == BF16)
        for (; k < K; k++) ((uint16_t*)o)[k] = f32_to_bf16((float)row[k] * s);
    else
        for (; k < K; k++) ((float*)o)[k] = (float)row[k] * s;
}

/* out[N][K] (dtype dt) = the int8 or int4 weight, dequantised in one pass. */
void qvl_dequantize(int kind, const void* w, const void* scale, const void* zero, int64_t gs, int64_t N, int64_t K,
                    int dt, void* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
    for (int64_t n = 0; n < N; n++) {
        if (kind == W_INT8) {
            dequantize_int8_row((const int8_t*)w + n * K, get(scale, dt, n), dt,
                                (char*)out + n * K * (dt == BF16 ? 2 : 4), K);
            continue;
        }
        const uint8_t* row = (const uint8_t*)w + n * (K / 2);
        const int64_t G = K / gs;
        for (int64_t g = 0; g < G; g++) {
            float s = get(scale, dt, n * G + g), z = get(zero, dt, n * G + g) - 8.f * s;
            const uint8_t* b = row + g * gs / 2;
            if (dt == BF16) {
                uint16_t* o = (uint16_t*)out + n * K + g * gs;
                for (int64_t i = 0; i < gs / 2; i++) {
                    o[2 * i] = f32_to_bf16((float)(b[i] & 0x0F) * s + z);
                    o[2 * i + 1] = f32_to_bf16((float)(b[i] >> 4) * s + z);
                }
            } else {
                float* o = (float*)out + n * K + g * gs;
                for (int64_t i = 0; i < gs / 2; i++) {
                    o[2 * i] = (float)(b[i] & 0x0F) * s + z;
                    o[2 * i + 1] = (float)(b[i] >> 4) * s + z;
                }
            }
        }
    }
}