/* The activation quantisers: float32 rows -> integer codes and their steps, one function per
 * scheme (code width, grouping and rounding differ between the kernels that use them; each
 * comment names its users). */
#ifndef QVL_QUANTISE_H
#define QVL_QUANTISE_H
#include "common.h"

/* The step of a chunk's symmetric codes up to +-levels: max |x| / levels, 1 for an all-zero
 * chunk, NaN when the chunk holds a NaN or infinity (its codes are then zeros and its row comes
 * out NaN, leaving the other rows alone). */
static inline float chunk_step(const float* x, float levels) {
    if (!all_finite(x, CHUNK)) return NAN;
    const float amax = absmax(x, CHUNK);
    return amax > 0.f ? amax / levels : 1.f;
}

/* Decode GEMV, int8 weights (gemv.c; amx_gemm.c's qvl_amx_codes splits the same codes): x / step
 * rounded to int16 per 128-column chunk, step max|chunk| / 32767 (chunk_step). */
typedef struct {
    int16_t* q;    /* [M][K] */
    float* scale;  /* [M][K/CHUNK] */
} Q16;

static inline void quantize16(const float* x, int64_t M, int64_t K, Q16* qx, int threads) {
    const int64_t C = K / CHUNK;
#pragma omp parallel for num_threads(M >= 32 ? threads : 1) schedule(dynamic, 4)
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < C; c++) {
            const float* xc = x + m * K + c * CHUNK;
            const float scale = chunk_step(xc, 32767.f), inv = 1.f / scale;
            int16_t* q = qx->q + m * K + c * CHUNK;
            if (isnan(scale)) {
                memset(q, 0, CHUNK * sizeof(int16_t));
            } else {
#pragma omp simd
                for (int j = 0; j < CHUNK; j++) q[j] = (int16_t)round_int(xc[j] * inv);
            }
            qx->scale[m * C + c] = scale;
        }
}

/* Decode GEMV, int4 weights (gemv.c): per row, per 128-column chunk, step max|chunk| / 127
 * (chunk_step) and 64 int8 codes of the even columns then 64 of the odd ones (matching the
 * nibbles of 64 weight bytes); and the float sum of x over each weight group (for the zeros). */
typedef struct {
    int8_t* q;     /* [M][K] */
    float* scale;  /* [M][K/CHUNK] */
    float* sum;    /* [M][K/gs] */
    float* unit;   /* [M][K/gs] when gs < CHUNK: each group's activation scale (its chunk's) */
} QuantX;

static inline void quantize_activations(const float* x, int64_t M, int64_t K, int64_t gs, QuantX* qx) {
    const int64_t C = K / CHUNK, G = K / gs;
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * K;
        for (int64_t c = 0; c < C; c++) {
            const float* xc = xr + c * CHUNK;
            const float scale = chunk_step(xc, 127.f), inv = 1.f / scale;
            int8_t* q = qx->q + m * K + c * CHUNK;
            if (isnan(scale)) {
                memset(q, 0, CHUNK);
            } else {
#pragma omp simd
                for (int i = 0; i < CHUNK / 2; i++) {
                    q[i] = (int8_t)round_int(xc[2 * i] * inv);
                    q[CHUNK / 2 + i] = (int8_t)round_int(xc[2 * i + 1] * inv);
                }
            }
            qx->scale[m * C + c] = scale;
        }
        for (int64_t g = 0; g < G; g++) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) s += xr[k];
            qx->sum[m * G + g] = s;
            if (qx->unit) qx->unit[m * G + g] = qx->scale[m * C + g * gs / CHUNK];
        }
    }
}

/* Prefill's 16-bit pair kernel (prefill_gemm.c): one row's symmetric int16 codes, x * 32767 /
 * top rounded half away from zero (top = max|row|), and the row's step top / 32767. A row with
 * NaN or infinity (finite 0) gives step NaN; a zero row, or one too small for 32767 / top to be
 * finite (max < 1e-34), step 0; neither writes codes (*coded 0). */
static inline float row_codes16(const float* row, int64_t K, int finite, float top, int16_t* codes, int* coded) {
    const float inv = top > 0.f ? 32767.f / top : 0.f;
    *coded = finite && top > 0.f && inv <= FLT_MAX;
    if (*coded) {
#pragma omp simd
        for (int64_t k = 0; k < K; k++) codes[k] = (int16_t)round_int(row[k] * inv); /* |code| <= 32767 */
    }
    return !finite ? NAN : *coded ? top / 32767.f : 0.f;
}

/* The byte-code kernel (byte_gemm.c): one group's symmetric codes up to +-levels (127; 63 for
 * plain AVX2's 7-bit codes), x * levels / top rounded half away from zero (top = max|group|),
 * their sum in *sum, and the group's step top / levels. A group too small for levels / top to be
 * finite, or zero, gives step 0 and zero codes; a row with NaN or infinity (finite 0), step NaN. */
static inline float group_codes8(const float* x, int64_t n, int finite, float top, float levels, int8_t* codes,
                                 int32_t* sum) {
    const float inv = top > 0.f ? levels / top : 0.f;
    const int coded = top > 0.f && inv <= FLT_MAX;
    int32_t s = 0;
    if (coded) {
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < n; k++) {
            const int32_t q = round_int(x[k] * inv); /* |q| <= levels */
            codes[k] = (int8_t)q, s += q;
        }
    } else {
        memset(codes, 0, (size_t)n);
    }
    *sum = s;
    return !finite ? NAN : coded ? top / levels : 0.f;
}

/* oneDNN's and AMX's int8 x int8 GEMMs (int8_passes.c's qvl_quantize_rows): one row's unsigned
 * codes 0..levels, (x - lo) / step rounded to nearest (truncating x + 0.5), lo = min(row), step =
 * (max - lo) / levels (1 for a constant row); q's bytes K..ldq-1 zero. */
static inline void row_codes_u8(const float* row, int64_t K, int levels, uint8_t* q, int64_t ldq, float* scale,
                                float* lo) {
    float mn = row[0], mx = row[0];
    int64_t k = 0;
#ifdef QVL_AVX512
    __m512 vmn = _mm512_set1_ps(mn), vmx = vmn;
    for (; k + 16 <= K; k += 16) {
        const __m512 r = _mm512_loadu_ps(row + k);
        vmn = _mm512_min_ps(vmn, r), vmx = _mm512_max_ps(vmx, r);
    }
    mn = _mm512_reduce_min_ps(vmn), mx = _mm512_reduce_max_ps(vmx);
#endif
    for (; k < K; k++) {
        mn = row[k] < mn ? row[k] : mn;
        mx = row[k] > mx ? row[k] : mx;
    }
    float s = mx > mn ? (mx - mn) / (float)levels : 1.f, inv = 1.f / s, top = (float)levels;
    memset(q + K, 0, (size_t)(ldq - K));
    k = 0; /* v = (x - mn) * inv + 0.5 >= 0.5: truncation rounds to nearest */
#ifdef QVL_AVX512
    const __m512 vlo = _mm512_set1_ps(mn), vinv = _mm512_set1_ps(inv), half = _mm512_set1_ps(0.5f),
                 vtop = _mm512_set1_ps(top);
    for (; k + 16 <= K; k += 16) {
        const __m512 v = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_loadu_ps(row + k), vlo), vinv, half);
        _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtusepi32_epi8(_mm512_cvttps_epi32(_mm512_min_ps(v, vtop))));
    }
#endif
    for (; k < K; k++) {
        const float v = fmaf(row[k] - mn, inv, 0.5f);
        q[k] = (uint8_t)(int32_t)(v < top ? v : top);
    }
    *scale = s;
    *lo = mn;
}

#endif
