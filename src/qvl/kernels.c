/* qvl's native CPU kernels: matrix-vector products for decoding (a few activation rows
 * against bf16, int8 or int4 weights), one-pass dequantisation for prefill, the passes
 * around torch._int_mm for int8 x int8 GEMMs (tanh-GELU fused into the second), flash
 * attention (vision, causal prefill), attention of one query over the KV cache, the vision
 * tower's RoPE, RMSNorm, and a whole decode step through every decoder layer in one call.
 *
 * Compiled on first use for the CPU it runs on (cc -O3 -march=native, see native.py), so
 * the AVX-512 paths exist only where the CPU has AVX-512; elsewhere the portable loops
 * are what the compiler vectorises for that CPU.
 *
 * Layouts (row-major, one row per output channel n):
 *   bf16 weights  w[N][K] uint16
 *   int8 weights  w[N][K] int8, scale[N]                       w = q * scale
 *   int4 weights  w[N][K/2] uint8 (column 2i in the low nibble of byte i, 2i+1 in the high),
 *                 scale[N][K/g], zero[N][K/g]                  w = (q - 8) * scale + zero
 * Activations x[M][K] and outputs y[M][N] are float32 (dt 0) or bfloat16 (dt 1); scales,
 * zeros and bias use the same dtype.
 *
 * With AVX-512, int4 products quantise the activations to int8 per 128 columns and use
 * integer dot products (VNNI where present), as llama.cpp does for its 4-bit formats; with
 * VNNI, int8 products split each activation into two exact bytes (16 bits per 128 columns);
 * the other paths accumulate exact float products in float32. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QVL_AVX512 1
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1 };
enum { W_BF16 = 0, W_INT8 = 1, W_INT4 = 2 };
#define TILE 4     /* activation rows sharing one pass over a weight row */
#define CHUNK 128  /* int4 columns per activation scale */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float get(const void* p, int dt, int64_t i) {
    return dt == BF16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void put(void* p, int dt, int64_t i, float v) {
    if (dt == BF16)
        ((uint16_t*)p)[i] = f32_to_bf16(v);
    else
        ((float*)p)[i] = v;
}

/* Round to nearest (ties away from zero); unlike lrintf, loops over it vectorise. */
static inline int32_t round_int(float v) { return (int32_t)(v + (v >= 0.f ? 0.5f : -0.5f)); }

/* max |x[i]| over n values: what a symmetric quantisation scale is made from. */
static inline float absmax(const float* x, int64_t n) {
    float m = 0.f;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
    }
    return m;
}

static inline float int4_at(const uint8_t* row, int64_t k) {
    uint8_t b = row[k >> 1];
    return (float)((k & 1) ? (b >> 4) : (b & 0x0F));
}

/* ---- portable row products (exact float accumulation) --------------------------------- */

static float dot_bf16(const float* x, const uint16_t* w, int64_t K) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; k++) s += bf16_to_f32(w[k]) * x[k];
    return s;
}

static float dot_int8(const float* x, const int8_t* w, int64_t K) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; k++) s += (float)w[k] * x[k];
    return s;
}

static float dot_int4(const float* x, const uint8_t* w, const void* sc, const void* zr, int dt, int64_t K,
                      int64_t gs) {
    float total = 0.f;
    for (int64_t g = 0; g < K / gs; g++) {
        float s = get(sc, dt, g), z = get(zr, dt, g), part = 0.f;
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) part += ((int4_at(w, k) - 8.f) * s + z) * x[k];
        total += part;
    }
    return total;
}

/* ---- AVX-512 row products --------------------------------------------------------------- */
#ifdef QVL_AVX512

static inline __m512 bf16x16_to_ps(__m256i h) { /* 16 bf16 -> 16 float32, exactly */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 exp2_ps(__m512 x) { /* 2^x, relative error ~2e-6 (minimax, degree 5) */
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3534167e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6588929e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503406e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022217e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314699e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 div_one_plus_exp2(__m512 x, __m512 t) { /* x / (1 + 2^t): SiLU and tanh-GELU */
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp2_ps(t)));
}

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

static inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i s) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

static inline __m512 load_scales(const void* p, int dt, int64_t at, __mmask16 mask) {
    if (dt == BF16) return bf16x16_to_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t*)p + at));
    return _mm512_maskz_loadu_ps(mask, (const float*)p + at);
}

/* Activations prepared for int4 products: per row, per 128-column chunk, 64 int8 values of
 * the even columns then 64 of the odd ones (matching the nibbles of 64 weight bytes), the
 * chunk's scale, and the exact float sum of x over each weight group (for the zeros). */
typedef struct {
    int8_t* q;     /* [M][K] */
    float* scale;  /* [M][K/CHUNK] */
    float* sum;    /* [M][K/gs] */
} QuantX;

#ifdef __AVX512VNNI__
/* Activations for int8 products: per 128-column chunk, x / scale rounded to 16 bits and
 * offset by 32768 into two unsigned bytes (hi, lo), so that integer dot products with the
 * int8 weights are exact: sum w*xq = 256 sum w*hi + sum w*lo - 32768 sum w. The rounding
 * error (1/65534 of the chunk's largest value) is below bf16's. */
typedef struct {
    uint8_t* hi;   /* [M][K] */
    uint8_t* lo;   /* [M][K] */
    float* scale;  /* [M][K/CHUNK] */
} SplitX;

static void split_activations(const float* x, int64_t M, int64_t K, SplitX* sx) {
    const int64_t C = K / CHUNK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < C; c++) {
            const float* xc = x + m * K + c * CHUNK;
            float amax = absmax(xc, CHUNK);
            float scale = amax > 0.f ? amax / 32767.f : 1.f, inv = 1.f / scale;
            for (int j = 0; j < CHUNK; j++) {
                uint32_t u = (uint32_t)(round_int(xc[j] * inv) + 32768);
                sx->hi[m * K + c * CHUNK + j] = (uint8_t)(u >> 8);
                sx->lo[m * K + c * CHUNK + j] = (uint8_t)(u & 0xFF);
            }
            sx->scale[m * C + c] = scale;
        }
}

static inline __attribute__((always_inline)) void dot_int8_tile(const SplitX* sx, int64_t m0, int64_t K,
                                                                const int8_t* w, float* out, const int mt) {
    const int64_t C = K / CHUNK;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 acc[TILE];
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
        __m512i w0 = _mm512_loadu_si512(w + c * CHUNK), w1 = _mm512_loadu_si512(w + c * CHUNK + 64);
        __m512i wsum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w0), ones, w1);
        __m512i offset = _mm512_slli_epi32(wsum, 15);
        for (int m = 0; m < mt; m++) {
            const uint8_t* hi = sx->hi + (m0 + m) * K + c * CHUNK;
            const uint8_t* lo = sx->lo + (m0 + m) * K + c * CHUNK;
            __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(hi), w0);
            a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(hi + 64), w1);
            __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(lo), w0);
            b = _mm512_dpbusd_epi32(b, _mm512_loadu_si512(lo + 64), w1);
            __m512i d = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(a, 8), b), offset);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(sx->scale[(m0 + m) * C + c]), acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
}
#endif

static void quantize_activations(const float* x, int64_t M, int64_t K, int64_t gs, QuantX* qx) {
    const int64_t C = K / CHUNK, G = K / gs;
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * K;
        for (int64_t c = 0; c < C; c++) {
            const float* xc = xr + c * CHUNK;
            float amax = absmax(xc, CHUNK);
            float scale = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / scale;
            int8_t* q = qx->q + m * K + c * CHUNK;
            for (int i = 0; i < CHUNK / 2; i++) {
                q[i] = (int8_t)round_int(xc[2 * i] * inv);
                q[CHUNK / 2 + i] = (int8_t)round_int(xc[2 * i + 1] * inv);
            }
            qx->scale[m * C + c] = scale;
        }
        for (int64_t g = 0; g < G; g++) {
            float s = 0.f;
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) s += xr[k];
            qx->sum[m * G + g] = s;
        }
    }
}

/* Lane j of a chunk's integer dot product covers columns 8j..8j+7, so its weight scale is
 * that of group (c * 128 + 8j) / gs: loaded per chunk and spread by `spread`. */
static inline __attribute__((always_inline)) void dot_int4_tile(const QuantX* qx, int64_t m0, int64_t K, int64_t gs,
                                                                const uint8_t* w, const void* sc, const void* zr,
                                                                int dt, float* out, const int mt) {
    const int64_t C = K / CHUNK, G = K / gs;
    const int per_chunk = gs >= CHUNK ? 1 : (int)(CHUNK / gs);
    const __mmask16 mask = (__mmask16)((1u << per_chunk) - 1);
    int idx[16];
    for (int j = 0; j < 16; j++) idx[j] = gs >= CHUNK ? 0 : (int)(8 * j / gs);
    const __m512i spread = _mm512_loadu_si512(idx);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc[TILE];
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
        __m512i v = _mm512_loadu_si512(w + c * (CHUNK / 2));
        __m512i lo = _mm512_and_si512(v, nibble);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        __m512 s = _mm512_permutexvar_ps(spread, load_scales(sc, dt, c * CHUNK / gs, mask));
        for (int m = 0; m < mt; m++) {
            const int8_t* xq = qx->q + (m0 + m) * K + c * CHUNK;
            __m512i d = dot_u8s8(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq));
            d = dot_u8s8(d, hi, _mm512_loadu_si512(xq + CHUNK / 2));
            __m512 sx = _mm512_mul_ps(s, _mm512_set1_ps(qx->scale[(m0 + m) * C + c]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sx, acc[m]);
        }
    }
    /* + sum_g (zero_g - 8 scale_g) * sum(x over g) */
    for (int m = 0; m < mt; m++) {
        const float* xs = qx->sum + (m0 + m) * G;
        __m512 off = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; g += 16) {
            __mmask16 gm = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
            __m512 z = load_scales(zr, dt, g, gm), s8 = _mm512_mul_ps(load_scales(sc, dt, g, gm), _mm512_set1_ps(8.f));
            off = _mm512_fmadd_ps(_mm512_sub_ps(z, s8), _mm512_maskz_loadu_ps(gm, xs + g), off);
        }
        out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], off));
    }
}
#endif /* QVL_AVX512 */

/* out[m] = row n of W . x[m0 + m] for the rows of one tile. */
static void row_products(int kind, const float* xf, const void* qxv, const void* sxv, int64_t m0, int64_t mt, int64_t K, int64_t gs,
                         const void* w, const void* sc, const void* zr, int dt, int64_t n, float* out) {
    const int64_t G = kind == W_INT4 ? K / gs : 0;
    const size_t esize = dt == BF16 ? 2 : 4;
    const void* wrow = kind == W_INT4   ? (const void*)((const uint8_t*)w + n * (K / 2))
                       : kind == W_INT8 ? (const void*)((const int8_t*)w + n * K)
                                        : (const void*)((const uint16_t*)w + n * K);
    const void* srow = kind == W_INT4 ? (const char*)sc + n * G * esize : NULL;
    const void* zrow = kind == W_INT4 ? (const char*)zr + n * G * esize : NULL;
#ifdef QVL_AVX512
    if (kind == W_INT4 && qxv) {
        const QuantX* qx = (const QuantX*)qxv;
        switch (mt) {
            case 4: dot_int4_tile(qx, m0, K, gs, wrow, srow, zrow, dt, out, 4); return;
            case 3: dot_int4_tile(qx, m0, K, gs, wrow, srow, zrow, dt, out, 3); return;
            case 2: dot_int4_tile(qx, m0, K, gs, wrow, srow, zrow, dt, out, 2); return;
            default: dot_int4_tile(qx, m0, K, gs, wrow, srow, zrow, dt, out, 1); return;
        }
    }
#ifdef __AVX512VNNI__
    if (kind == W_INT8 && sxv) {
        const SplitX* sx = (const SplitX*)sxv;
        switch (mt) {
            case 4: dot_int8_tile(sx, m0, K, wrow, out, 4); return;
            case 3: dot_int8_tile(sx, m0, K, wrow, out, 3); return;
            case 2: dot_int8_tile(sx, m0, K, wrow, out, 2); return;
            default: dot_int8_tile(sx, m0, K, wrow, out, 1); return;
        }
    }
#endif
    if (kind == W_INT8) {
        switch (mt) {
            case 4: dot_float_tile(xf + m0 * K, K, wrow, out, W_INT8, 4); return;
            case 3: dot_float_tile(xf + m0 * K, K, wrow, out, W_INT8, 3); return;
            case 2: dot_float_tile(xf + m0 * K, K, wrow, out, W_INT8, 2); return;
            default: dot_float_tile(xf + m0 * K, K, wrow, out, W_INT8, 1); return;
        }
    }
    if (kind == W_BF16) {
        switch (mt) {
            case 4: dot_float_tile(xf + m0 * K, K, wrow, out, W_BF16, 4); return;
            case 3: dot_float_tile(xf + m0 * K, K, wrow, out, W_BF16, 3); return;
            case 2: dot_float_tile(xf + m0 * K, K, wrow, out, W_BF16, 2); return;
            default: dot_float_tile(xf + m0 * K, K, wrow, out, W_BF16, 1); return;
        }
    }
#else
    (void)qxv, (void)sxv;
#endif
    for (int64_t m = 0; m < mt; m++) {
        const float* xr = xf + (m0 + m) * K;
        out[m] = kind == W_INT4   ? dot_int4(xr, wrow, srow, zrow, dt, K, gs)
                 : kind == W_INT8 ? dot_int8(xr, wrow, K)
                                  : dot_bf16(xr, wrow, K);
    }
}

/* y[M][N] = x[M][K] . W^T (+ bias), W in one of the layouts above. Returns 0, or -1 when
 * out of memory. */
int qvl_linear(int kind, const void* x, int dt, int64_t M, int64_t K, int64_t N, const void* w, const void* scale,
               const void* zero, int64_t gs, const void* bias, void* y, int threads) {
    float* xf = malloc((size_t)(M * K) * sizeof(float));
    if (!xf) return -1;
    for (int64_t i = 0; i < M * K; i++) xf[i] = get(x, dt, i);
    void* qxv = NULL;
#ifdef QVL_AVX512
    QuantX qx = {NULL, NULL, NULL};
    if (kind == W_INT4 && K % CHUNK == 0 && gs % 32 == 0) {
        qx.q = malloc((size_t)(M * K));
        qx.scale = malloc((size_t)(M * (K / CHUNK)) * sizeof(float));
        qx.sum = malloc((size_t)(M * (K / gs)) * sizeof(float));
        if (!qx.q || !qx.scale || !qx.sum) {
            free(qx.q), free(qx.scale), free(qx.sum), free(xf);
            return -1;
        }
        quantize_activations(xf, M, K, gs, &qx);
        qxv = &qx;
    }
#endif
    void* sxv = NULL;
#ifdef __AVX512VNNI__
    SplitX sx = {NULL, NULL, NULL};
    if (kind == W_INT8 && K % CHUNK == 0) {
        sx.hi = malloc((size_t)(M * K));
        sx.lo = malloc((size_t)(M * K));
        sx.scale = malloc((size_t)(M * (K / CHUNK)) * sizeof(float));
        if (!sx.hi || !sx.lo || !sx.scale) {
            free(sx.hi), free(sx.lo), free(sx.scale), free(xf);
            return -1;
        }
        split_activations(xf, M, K, &sx);
        sxv = &sx;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float out[TILE];
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            int64_t mt = M - m0 < TILE ? M - m0 : TILE;
            row_products(kind, xf, qxv, sxv, m0, mt, K, gs, w, scale, zero, dt, n, out);
            for (int64_t m = 0; m < mt; m++) {
                float v = out[m];
                if (kind == W_INT8) v *= get(scale, dt, n);
                if (bias) v += get(bias, dt, n);
                put(y, dt, (m0 + m) * N + n, v);
            }
        }
    }
#ifdef QVL_AVX512
    free(qx.q), free(qx.scale), free(qx.sum);
#endif
#ifdef __AVX512VNNI__
    free(sx.hi), free(sx.lo), free(sx.scale);
#endif
    free(xf);
    return 0;
}

/* out[N][K] (dtype dt) = the int8 or int4 weight, dequantised in one pass. */
void qvl_dequantize(int kind, const void* w, const void* scale, const void* zero, int64_t gs, int64_t N, int64_t K,
                    int dt, void* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        if (kind == W_INT8) {
            const int8_t* row = (const int8_t*)w + n * K;
            float s = get(scale, dt, n);
            if (dt == BF16) {
                uint16_t* o = (uint16_t*)out + n * K;
                for (int64_t k = 0; k < K; k++) o[k] = f32_to_bf16((float)row[k] * s);
            } else {
                float* o = (float*)out + n * K;
                for (int64_t k = 0; k < K; k++) o[k] = (float)row[k] * s;
            }
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

/* ---- int8 x int8 GEMMs (many rows): the parts around torch._int_mm ------------------ */

/* xq[M][K] int8 and scale[M] = x quantised symmetrically per row (x ~= xq * scale).
 * Returns 0, or -1 when out of memory. */
int qvl_quantize_rows(const void* x, int dt, int64_t M, int64_t K, int8_t* xq, float* scale, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float* row = malloc((size_t)K * sizeof(float));
        if (!row) failed = 1;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (!row) continue;
            if (dt == BF16) {
                const uint16_t* xr = (const uint16_t*)x + m * K;
#pragma omp simd
                for (int64_t k = 0; k < K; k++) row[k] = bf16_to_f32(xr[k]);
            } else {
                memcpy(row, (const float*)x + m * K, (size_t)K * sizeof(float));
            }
            float amax = absmax(row, K);
            float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
            int8_t* q = xq + m * K;
#pragma omp simd
            for (int64_t k = 0; k < K; k++) q[k] = (int8_t)round_int(row[k] * inv);
            scale[m] = s;
        }
        free(row);
    }
    return failed ? -1 : 0;
}

/* v[n] <- tanh-GELU(v[n]) = v / (1 + exp(-2u)), u = sqrt(2/pi) (v + 0.044715 v^3), in float32. */
static void gelu_tanh(float* v, int64_t n) {
    int64_t i = 0;
#ifdef QVL_AVX512
    const __m512 c1 = _mm512_set1_ps(-2.f * 0.7978845608f * 1.4426950409f), c3 = _mm512_set1_ps(0.044715f);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(v + i);
        __m512 u = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_mul_ps(c3, x), _mm512_mul_ps(x, x), x), c1);
        _mm512_storeu_ps(v + i, div_one_plus_exp2(x, u));
    }
#endif
    for (; i < n; i++) v[i] = 0.5f * v[i] * (1.f + tanhf(0.7978845608f * (v[i] + 0.044715f * v[i] * v[i] * v[i])));
}

/* y[M][N] (dt) = acc[M][N] * row_scale[m] * col_scale[n] (+ bias[n]), then tanh-GELU when
 * `gelu` (applied before the one rounding to bf16). Returns 0, or -1 when out of memory. */
int qvl_rescale(const int32_t* acc, const float* row_scale, const void* col_scale, const void* bias, int dt,
                int64_t M, int64_t N, int gelu, void* y, int threads) {
    float* cs = malloc((size_t)N * sizeof(float));
    float* b = malloc((size_t)N * sizeof(float));
    if (!cs || !b) {
        free(cs), free(b);
        return -1;
    }
    for (int64_t n = 0; n < N; n++) {
        cs[n] = get(col_scale, dt, n);
        b[n] = bias ? get(bias, dt, n) : 0.f;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float* row = malloc((size_t)N * sizeof(float));
        if (!row) failed = 1;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (!row) continue;
            const int32_t* a = acc + m * N;
            float rs = row_scale[m];
#pragma omp simd
            for (int64_t n = 0; n < N; n++) row[n] = (float)a[n] * rs * cs[n] + b[n];
            if (gelu) gelu_tanh(row, N);
            if (dt == BF16) {
                uint16_t* o = (uint16_t*)y + m * N;
#pragma omp simd
                for (int64_t n = 0; n < N; n++) o[n] = f32_to_bf16(row[n]);
            } else {
                memcpy((float*)y + m * N, row, (size_t)N * sizeof(float));
            }
        }
        free(row);
    }
    free(cs), free(b);
    return failed ? -1 : 0;
}

/* ---- attention (vision, causal prefill, decoding over the KV cache), AVX512-BF16 ---- */
#if defined(QVL_AVX512) && defined(__AVX512BF16__)
#define ABK 64 /* keys per step */
#define ATQ 4  /* query rows per tile (ATQ x ABK/16 score accumulators) */
#define ABQ 64 /* query rows per block (its keys and values stay in L1 across the tiles) */
#define NKB (ABK / 16)
#define MAX_SLACK 8.f /* log2 units */

/* One step of attention_block: query rows t..t+ATQ against keys kb..kb+ABK. `masked` (a
 * constant after inlining) = some of those keys are hidden from some rows (causal diagonal,
 * padding past S); most steps have none and skip the masking. */
static inline __attribute__((always_inline)) void attention_tile(
    const uint16_t* qb, const uint32_t* kp, const uint32_t* vp, int64_t S, int64_t S_pad, int64_t causal,
    __m512 scale, int t, int64_t kb, float* o, float* mx, float* l, uint16_t* pb, const int D, const int masked) {
    const int GR = D == 64 ? 4 : 2; /* rows per value-product group: GR x D/16 accumulators */
    float corr[ATQ];
    __mmask16 mask[ATQ][NKB];
    for (int i = 0; i < ATQ; i++) {
        int64_t seen = causal < 0 ? S : (causal + t + i + 1 < S ? causal + t + i + 1 : S);
        for (int b = 0; b < NKB; b++) {
            int64_t left = masked ? seen - kb - 16 * b : 16;
            mask[i][b] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
        }
    }
    __m512 sc[ATQ][NKB];
    for (int i = 0; i < ATQ; i++)
        for (int b = 0; b < NKB; b++) sc[i][b] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; p++) {
        __m512bh kv[NKB];
        for (int b = 0; b < NKB; b++) kv[b] = (__m512bh)_mm512_loadu_si512(kp + p * S_pad + kb + 16 * b);
        for (int i = 0; i < ATQ; i++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)((const uint32_t*)(qb + (t + i) * D))[p]);
            for (int b = 0; b < NKB; b++) sc[i][b] = _mm512_dpbf16_ps(sc[i][b], a, kv[b]);
        }
    }
    for (int i = 0; i < ATQ; i++) {
        const __m512 low = _mm512_set1_ps(-1e30f);
        __m512 top = low;
        for (int b = 0; b < NKB; b++) {
            sc[i][b] = masked ? _mm512_mask_mul_ps(low, mask[i][b], sc[i][b], scale) : _mm512_mul_ps(sc[i][b], scale);
            top = _mm512_max_ps(top, sc[i][b]);
        }
        /* the running max moves only when a score passes it by more than MAX_SLACK (so the
         * exponentials stay below 2^MAX_SLACK): most tiles skip the reduction and rescale */
        float prev = mx[t + i];
        corr[i] = 1.f;
        if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(prev + MAX_SLACK), _CMP_GT_OQ)) {
            float now = _mm512_reduce_max_ps(top);
            corr[i] = exp2f(prev - now);
            mx[t + i] = now;
            _mm512_store_ps(l + (t + i) * 16, _mm512_mul_ps(_mm512_load_ps(l + (t + i) * 16), _mm512_set1_ps(corr[i])));
        }
        __m512 nv = _mm512_set1_ps(mx[t + i]), sum = _mm512_load_ps(l + (t + i) * 16);
        for (int b = 0; b < NKB; b++) {
            sc[i][b] = exp2_ps(_mm512_sub_ps(sc[i][b], nv));
            if (masked) sc[i][b] = _mm512_maskz_mov_ps(mask[i][b], sc[i][b]);
            /* summed as rounded to bf16, i.e. as the value product below weighs them */
            sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(sc[i][b])));
        }
        _mm512_store_ps(l + (t + i) * 16, sum);
        for (int b = 0; b < NKB; b += 2)
            _mm512_storeu_si512(pb + i * ABK + 16 * b, (__m512i)_mm512_cvtne2ps_pbh(sc[i][b + 1], sc[i][b]));
    }
    for (int g = 0; g < ATQ; g += GR) {
        __m512 acc[4][8];
        for (int i = 0; i < GR; i++)
            for (int d = 0; d < D / 16; d++) {
                __m512 prev = _mm512_loadu_ps(o + (t + g + i) * D + 16 * d);
                acc[i][d] = corr[g + i] == 1.f ? prev : _mm512_mul_ps(prev, _mm512_set1_ps(corr[g + i]));
            }
        for (int jp = 0; jp < ABK / 2; jp++) {
            const uint32_t* vrow = vp + (kb / 2 + jp) * D;
            for (int i = 0; i < GR; i++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32((int)((const uint32_t*)(pb + (g + i) * ABK))[jp]);
                for (int d = 0; d < D / 16; d++)
                    acc[i][d] = _mm512_dpbf16_ps(acc[i][d], a, (__m512bh)_mm512_loadu_si512(vrow + 16 * d));
            }
        }
        for (int i = 0; i < GR; i++)
            for (int d = 0; d < D / 16; d++) _mm512_storeu_ps(o + (t + g + i) * D + 16 * d, acc[i][d]);
    }
}

/* Flash attention for the query rows [0, rows) of one head: scores and products in
 * AVX512-BF16 dot products with float32 accumulation, online softmax in float32.
 * kp: [D/2][S_pad] key pairs (k[n][2p], k[n][2p+1]); vp: [S_pad/2][D] value pairs
 * (v[2j][d], v[2j+1][d]); keys >= S are zero and masked. causal >= 0: row r sees keys
 * j <= causal + r only (causal = the first row's position); -1: every row sees all keys. */
static inline __attribute__((always_inline)) void attention_block(
    const uint16_t* q, int64_t q_stride, int64_t rows, const uint32_t* kp, const uint32_t* vp, int64_t S,
    int64_t S_pad, int64_t causal, float scale2, uint16_t* out, int64_t out_stride, const int D) {
    uint16_t qb[ABQ * 128] __attribute__((aligned(64)));
    float o[ABQ * 128] __attribute__((aligned(64)));
    uint16_t pb[ATQ * ABK] __attribute__((aligned(64)));
    float mx[ABQ], l[ABQ * 16] __attribute__((aligned(64))); /* running max; running sums per lane */
    for (int r = 0; r < ABQ; r++) {
        if (r < rows)
            memcpy(qb + r * D, q + r * q_stride, (size_t)D * 2);
        else
            memset(qb + r * D, 0, (size_t)D * 2);
        mx[r] = -1e30f;
    }
    memset(o, 0, sizeof(float) * ABQ * D);
    memset(l, 0, sizeof(l));
    const __m512 scale = _mm512_set1_ps(scale2);
    const int64_t key_end = causal < 0 ? S_pad : (causal + rows < S ? causal + rows : S); /* keys any row sees */
    for (int64_t kb = 0; kb < key_end; kb += ABK) {
        for (int t = 0; t < ABQ && t < rows; t += ATQ) {
            int64_t first_seen = causal < 0 ? S : (causal + t + 1 < S ? causal + t + 1 : S);
            if (kb + ABK <= first_seen)
                attention_tile(qb, kp, vp, S, S_pad, causal, scale, t, kb, o, mx, l, pb, D, 0);
            else
                attention_tile(qb, kp, vp, S, S_pad, causal, scale, t, kb, o, mx, l, pb, D, 1);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float inv = 1.f / _mm512_reduce_add_ps(_mm512_load_ps(l + r * 16));
        for (int d = 0; d < D; d++) out[r * out_stride + d] = f32_to_bf16(o[r * D + d] * inv);
    }
}

/* out = softmax(q k^T / sqrt(D)) v for T queries over S keys, grouped-query (query head h
 * uses key/value head h / (H / Hkv)). Every tensor is bf16 with D contiguous and strides
 * in elements: q[t][h] at t*q_tok + h*q_head, likewise k, v (positions j), out.
 * causal >= 0: query t sees keys j <= causal + t (prefill of positions causal..causal+T-1
 * over a cache of S = causal + T); -1: no mask (vision). D = 64 or 128.
 * Returns 0, -1 when out of memory, -2 when D or the heads are not supported. */
int qvl_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t T, int64_t S,
                  int64_t H, int64_t Hkv, int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                  int64_t v_tok, int64_t v_head, int64_t o_tok, int64_t o_head, int64_t causal, int threads) {
    if ((D != 64 && D != 128) || Hkv < 1 || H % Hkv != 0) return -2;
    const int64_t S_pad = (S + ABK - 1) / ABK * ABK, G = H / Hkv;
    uint32_t* kp = aligned_alloc(64, (size_t)(Hkv * S_pad * D * 2));
    uint32_t* vp = aligned_alloc(64, (size_t)(Hkv * S_pad * D * 2));
    if (!kp || !vp) {
        free(kp), free(vp);
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < Hkv; h++) {
        uint32_t* kh = kp + h * (D / 2) * S_pad;
        uint32_t* vh = vp + h * (S_pad / 2) * D;
        for (int64_t n = 0; n < S_pad; n++)
            for (int64_t p = 0; p < D / 2; p++)
                kh[p * S_pad + n] = n < S ? ((const uint32_t*)(k + n * k_tok + h * k_head))[p] : 0u;
        for (int64_t j = 0; j < S_pad; j += 2)
            for (int64_t d = 0; d < D; d++) {
                uint32_t lo = j < S ? v[j * v_tok + h * v_head + d] : 0u;
                uint32_t hi = j + 1 < S ? v[(j + 1) * v_tok + h * v_head + d] : 0u;
                vh[(j / 2) * D + d] = lo | (hi << 16);
            }
    }
    const int64_t blocks = (T + ABQ - 1) / ABQ;
    const float scale2 = 1.4426950408889634f / sqrtf((float)D); /* softmax in base 2 */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < H * blocks; item++) {
        /* head by head (its packed keys and values stay in L2), and within a head the last
         * (causally longest) blocks first, so the dynamic schedule balances */
        int64_t h = item / blocks, r0 = (blocks - 1 - item % blocks) * ABQ;
        int64_t rows = T - r0 < ABQ ? T - r0 : ABQ;
        const uint16_t* qh = q + r0 * q_tok + h * q_head;
        uint16_t* oh = out + r0 * o_tok + h * o_head;
        const uint32_t* kh = kp + (h / G) * (D / 2) * S_pad;
        const uint32_t* vh = vp + (h / G) * (S_pad / 2) * D;
        int64_t first = causal < 0 ? -1 : causal + r0;
        if (D == 64)
            attention_block(qh, q_tok, rows, kh, vh, S, S_pad, first, scale2, oh, o_tok, 64);
        else
            attention_block(qh, q_tok, rows, kh, vh, S, S_pad, first, scale2, oh, o_tok, 128);
    }
    free(kp), free(vp);
    return 0;
}

/* Rotary embedding of the vision tower's q or k, as the reference computes it: in float32,
 * x*cos + rotate_half(x)*sin (two products and a sum, each rounded: the explicit-rounding
 * intrinsics keep the compiler from fusing them into one FMA), rounded once to bf16.
 * x: bf16, row n head h at n*tok + h*head (D contiguous); cos/sin: [N][D] float32;
 * out: [N][H][D] bf16. Returns 0, or -2 when D is not a multiple of 32 up to 256. */
int qvl_vision_rope(const uint16_t* x, int64_t tok, int64_t head, int64_t N, int64_t H, int64_t D, const float* cos,
                    const float* sin, uint16_t* out, int threads) {
    if (D % 32 != 0 || D > 256) return -2;
    const int half = (int)(D / 32); /* 16-lane vectors per half */
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos + n * D, *s = sin + n * D;
        for (int64_t h = 0; h < H; h++) {
            const uint16_t* xr = x + n * tok + h * head;
            uint16_t* o = out + (n * H + h) * D;
            __m512 v[16];
            for (int j = 0; j < 2 * half; j++) v[j] = bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)(xr + 16 * j)));
            for (int j = 0; j < 2 * half; j++) {
                __m512 rot = j < half ? _mm512_sub_ps(_mm512_setzero_ps(), v[j + half]) : v[j - half];
                __m512 y = _mm512_add_round_ps(_mm512_mul_round_ps(v[j], _mm512_loadu_ps(c + 16 * j), rn),
                                               _mm512_mul_round_ps(rot, _mm512_loadu_ps(s + 16 * j), rn), rn);
                _mm256_storeu_si256((__m256i*)(o + 16 * j), (__m256i)_mm512_cvtneps_pbh(y));
            }
        }
    }
    return 0;
}

/* One new query per row against the KV cache (decoding), grouped-query: the G = H/Hkv query
 * heads of a key/value head read its keys and values once. q: [B][H][D]; keys/values: row
 * b, head h, position j at b*row_stride + h*head_stride + j*D; mask: [B][mask_stride] bytes
 * (nonzero = attend) or NULL; out: [B][H][D]. Scores and softmax in float32. */
int qvl_decode_attention(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int64_t row_stride,
                         int64_t head_stride, int64_t B, int64_t H, int64_t Hkv, int64_t L, int64_t D,
                         const uint8_t* mask, int64_t mask_stride, uint16_t* out, int threads) {
    if (D % 32 != 0 || D > 256 || H % Hkv != 0 || H / Hkv > 16) return -2;
    const int64_t G = H / Hkv;
    const float scale2 = 1.4426950408889634f / sqrtf((float)D);
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < B * Hkv; item++) {
        const int64_t b = item / Hkv, h = item % Hkv;
        const uint16_t* kh = keys + b * row_stride + h * head_stride;
        const uint16_t* vh = values + b * row_stride + h * head_stride;
        const uint8_t* mrow = mask ? mask + b * mask_stride : NULL;
        float* sc = malloc((size_t)(G * L) * sizeof(float));
        if (!sc) {
            failed = 1;
            continue;
        }
        const int nq = (int)(D / 32);
        for (int64_t g = 0; g < G; g++) {
            const uint16_t* qg = q + (b * H + h * G + g) * D;
            __m512bh qv[8];
            for (int c = 0; c < nq; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qg + 32 * c);
            float* sg = sc + g * L;
            float top = -1e30f;
            for (int64_t j = 0; j < L; j++) {
                if (mrow && !mrow[j]) {
                    sg[j] = -1e30f;
                    continue;
                }
                __m512 acc = _mm512_setzero_ps();
                for (int c = 0; c < nq; c++)
                    acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(kh + j * D + 32 * c));
                float v = _mm512_reduce_add_ps(acc) * scale2;
                sg[j] = v;
                top = v > top ? v : top;
            }
            float sum = 0.f;
            int64_t j = 0;
            const __m512 tv = _mm512_set1_ps(top);
            __m512 vsum = _mm512_setzero_ps();
            for (; j + 16 <= L; j += 16) {
                __m512 e = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + j), tv));
                e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(_mm512_loadu_ps(sg + j), _mm512_set1_ps(-1e29f), _CMP_LT_OQ),
                                       _mm512_setzero_ps());
                _mm512_storeu_ps(sg + j, e);
                vsum = _mm512_add_ps(vsum, e);
            }
            sum = _mm512_reduce_add_ps(vsum);
            for (; j < L; j++) {
                float e = sg[j] < -1e29f ? 0.f : exp2f(sg[j] - top);
                sg[j] = e;
                sum += e;
            }
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            for (j = 0; j < L; j++) sg[j] *= inv;
        }
        /* out[g] = sum_j p[g][j] v[j]: each value row converted once for all G heads */
        __m512 acc[16][8];
        for (int64_t g = 0; g < G; g++)
            for (int c = 0; c < 2 * nq; c++) acc[g][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < L; j++) {
            if (mrow && !mrow[j]) continue;
            __m512 vr[8];
            for (int c = 0; c < 2 * nq; c++) vr[c] = bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)(vh + j * D + 16 * c)));
            for (int64_t g = 0; g < G; g++) {
                __m512 pj = _mm512_set1_ps(sc[g * L + j]);
                for (int c = 0; c < 2 * nq; c++) acc[g][c] = _mm512_fmadd_ps(pj, vr[c], acc[g][c]);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            uint16_t* og = out + (b * H + h * G + g) * D;
            for (int c = 0; c < 2 * nq; c++) {
                float tmp[16];
                _mm512_storeu_ps(tmp, acc[g][c]);
                for (int i = 0; i < 16; i++) og[16 * c + i] = f32_to_bf16(tmp[i]);
            }
        }
        free(sc);
    }
    return failed ? -1 : 0;
}
#else
int qvl_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t T, int64_t S,
                  int64_t H, int64_t Hkv, int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                  int64_t v_tok, int64_t v_head, int64_t o_tok, int64_t o_head, int64_t causal, int threads) {
    (void)q, (void)k, (void)v, (void)out, (void)T, (void)S, (void)H, (void)Hkv, (void)D, (void)q_tok, (void)q_head,
        (void)k_tok, (void)k_head, (void)v_tok, (void)v_head, (void)o_tok, (void)o_head, (void)causal, (void)threads;
    return -2;
}

int qvl_vision_rope(const uint16_t* x, int64_t tok, int64_t head, int64_t N, int64_t H, int64_t D, const float* cos,
                    const float* sin, uint16_t* out, int threads) {
    (void)x, (void)tok, (void)head, (void)N, (void)H, (void)D, (void)cos, (void)sin, (void)out, (void)threads;
    return -2;
}

int qvl_decode_attention(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int64_t row_stride,
                         int64_t head_stride, int64_t B, int64_t H, int64_t Hkv, int64_t L, int64_t D,
                         const uint8_t* mask, int64_t mask_stride, uint16_t* out, int threads) {
    (void)q, (void)keys, (void)values, (void)row_stride, (void)head_stride, (void)B, (void)H, (void)Hkv, (void)L,
        (void)D, (void)mask, (void)mask_stride, (void)out, (void)threads;
    return -2;
}
#endif

/* Which paths this build has: 1 = AVX-512 GEMV, 2 = VNNI integer products, 4 = BF16 attention. */
int qvl_features(void) {
    int f = 0;
#ifdef QVL_AVX512
    f |= 1;
#ifdef __AVX512VNNI__
    f |= 2;
#endif
#ifdef __AVX512BF16__
    f |= 4;
#endif
#endif
    return f;
}

/* RMSNorm of bf16 rows as the reference computes it: float32 mean of squares, x * rsqrt(mean +
 * eps) rounded to bf16, times the bf16 weight, rounded again. x, w, out: bf16; x [rows][dim]. */
void qvl_rmsnorm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t rows, int64_t dim, float eps,
                      int threads) {
#pragma omp parallel for num_threads(rows >= 64 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * dim;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) {
            float v = bf16_to_f32(xr[i]);
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        uint16_t* o = out + r * dim;
        for (int64_t i = 0; i < dim; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * inv)));
    }
}

/* ---- a whole decode step through the decoder layers ---- */

/* One linear of a decoder layer, as qvl_linear takes it. */
typedef struct {
    int64_t kind, n, k, group_size;
    const void *w, *scale, *zero, *bias;
} QvlLinear;

typedef struct {
    const uint16_t *input_norm, *post_norm, *q_norm, *k_norm;
    QvlLinear q, k, v, o, gate, up, down;
} QvlLayer;

static inline float round_bf(float v) { return bf16_to_f32(f32_to_bf16(v)); }

static int layer_linear(const QvlLinear* l, const uint16_t* x, int64_t M, uint16_t* y, int threads) {
    return qvl_linear((int)l->kind, x, BF16, M, l->k, l->n, l->w, l->scale, l->zero, l->group_size, l->bias, y,
                      threads);
}

/* Rotary embedding of `heads` rows of D in place, rounded as the reference does in bf16:
 * x*cos + rotate_half(x)*sin, each product and the sum rounded to bf16. */
static void text_rope_bf16(uint16_t* x, int64_t heads, int64_t D, const uint16_t* cos, const uint16_t* sin) {
    const int64_t half = D / 2;
    float t[256];
    for (int64_t r = 0; r < heads; r++) {
        uint16_t* xr = x + r * D;
        for (int64_t i = 0; i < D; i++) t[i] = bf16_to_f32(xr[i]);
        for (int64_t i = 0; i < D; i++) {
            float rot = i < half ? -t[i + half] : t[i - half];
            xr[i] = f32_to_bf16(round_bf(t[i] * bf16_to_f32(cos[i])) + round_bf(rot * bf16_to_f32(sin[i])));
        }
    }
}

/* g <- silu(g) * u, rounded after silu and after the product (bf16 [n]). */
static void silu_mul_bf16(uint16_t* g, const uint16_t* u, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        int64_t end = i0 + 16 < n ? i0 + 16 : n;
#if defined(QVL_AVX512) && defined(__AVX512BF16__)
        if (end - i0 == 16) {
            __m512 x = bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)(g + i0)));
            __m512 s = div_one_plus_exp2(x, _mm512_mul_ps(x, _mm512_set1_ps(-1.4426950408889634f)));
            float sv[16];
            _mm512_storeu_ps(sv, s);
            for (int j = 0; j < 16; j++) g[i0 + j] = f32_to_bf16(round_bf(sv[j]) * bf16_to_f32(u[i0 + j]));
            continue;
        }
#endif
        for (int64_t i = i0; i < end; i++) {
            float x = bf16_to_f32(g[i]);
            g[i] = f32_to_bf16(round_bf(x / (1.f + expf(-x))) * bf16_to_f32(u[i]));
        }
    }
}

static void add_bf16(uint16_t* x, const uint16_t* a, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(a[i]));
}

/* One decode step (one new token per row) through all decoder layers, in place on the
 * hidden states x [B][D] bf16: per layer RMSNorm, q/k/v, per-head q/k norms, RoPE (cos/sin
 * [B][hd] bf16), the new keys/values written at position `pos` of the cache (layer l, row b,
 * head h, position j at l*layer_stride + b*row_stride + h*head_stride + j*hd), attention over
 * positions 0..pos (mask [B][mask_stride] bytes or NULL), o_proj + residual, RMSNorm, SwiGLU
 * MLP + residual. The same kernels and bf16 roundings as the per-op path. Returns 0, -1
 * when out of memory, -2 when this build or these shapes have no decode attention (before
 * anything is written). */
int qvl_decode_layers(const QvlLayer* layers, int64_t n_layers, uint16_t* x, int64_t B, int64_t D, int64_t H,
                      int64_t Hkv, int64_t hd, int64_t I, float eps, const uint16_t* cos, const uint16_t* sin,
                      uint16_t* keys, uint16_t* values, int64_t layer_stride, int64_t row_stride,
                      int64_t head_stride, int64_t pos, const uint8_t* mask, int64_t mask_stride, int threads) {
    if (!(qvl_features() & 4) || hd % 32 != 0 || hd > 256 || H % Hkv != 0 || H / Hkv > 16) return -2;
    const int64_t qn = B * H * hd, kn = B * Hkv * hd;
    uint16_t* buf = malloc((size_t)(2 * B * D + 2 * qn + 2 * kn + 2 * B * I) * sizeof(uint16_t));
    if (!buf) return -1;
    uint16_t *xn = buf, *a = xn + B * D, *q = a + B * D, *att = q + qn, *k = att + qn, *v = k + kn, *g = v + kn,
             *u = g + B * I;
    int status = 0;
    for (int64_t l = 0; l < n_layers && status == 0; l++) {
        const QvlLayer* L = layers + l;
        uint16_t *kc = keys + l * layer_stride, *vc = values + l * layer_stride;
        qvl_rmsnorm_bf16(x, L->input_norm, xn, B, D, eps, threads);
        if (layer_linear(&L->q, xn, B, q, threads) || layer_linear(&L->k, xn, B, k, threads) ||
            layer_linear(&L->v, xn, B, v, threads)) {
            status = -1;
            break;
        }
        qvl_rmsnorm_bf16(q, L->q_norm, q, B * H, hd, eps, threads);
        qvl_rmsnorm_bf16(k, L->k_norm, k, B * Hkv, hd, eps, threads);
        for (int64_t b = 0; b < B; b++) {
            text_rope_bf16(q + b * H * hd, H, hd, cos + b * hd, sin + b * hd);
            text_rope_bf16(k + b * Hkv * hd, Hkv, hd, cos + b * hd, sin + b * hd);
            for (int64_t h = 0; h < Hkv; h++) {
                int64_t at = b * row_stride + h * head_stride + pos * hd;
                memcpy(kc + at, k + (b * Hkv + h) * hd, (size_t)hd * sizeof(uint16_t));
                memcpy(vc + at, v + (b * Hkv + h) * hd, (size_t)hd * sizeof(uint16_t));
            }
        }
        status = qvl_decode_attention(q, kc, vc, row_stride, head_stride, B, H, Hkv, pos + 1, hd, mask, mask_stride,
                                      att, threads);
        if (status || layer_linear(&L->o, att, B, a, threads)) {
            status = status ? status : -1;
            break;
        }
        add_bf16(x, a, B * D);
        qvl_rmsnorm_bf16(x, L->post_norm, xn, B, D, eps, threads);
        if (layer_linear(&L->gate, xn, B, g, threads) || layer_linear(&L->up, xn, B, u, threads)) {
            status = -1;
            break;
        }
        silu_mul_bf16(g, u, B * I, threads);
        if (layer_linear(&L->down, g, B, a, threads)) {
            status = -1;
            break;
        }
        add_bf16(x, a, B * D);
    }
    free(buf);
    return status;
}
