/* The passes around oneDNN's int8 GEMM (many rows): activations quantised per row to unsigned
 * codes, and the rescale back to float (tanh-GELU fused into it). */
#include "common.h"

/* xq[M][K] = x quantised per row to the unsigned codes 0..levels (255; 127 where the GEMM
 * sums exactly only 7-bit activations): x ~= lo[m] + scale[m] * xq, lo the row's minimum.
 * With norm_w (dt [K], and norm_b or NULL): each row is first layer-normalised as the model's
 * LayerNorm does (float32 mean and variance, the result rounded to dt), so the normalised rows
 * are never written. Returns 0, or -1 when out of memory. */
int qvl_quantize_rows(const void* x, int dt, int64_t M, int64_t K, int levels, const void* norm_w, const void* norm_b,
                      float eps, uint8_t* xq, float* scale, float* lo, int threads) {
    float *nw = NULL, *nb = NULL;
    if (norm_w) {
        nw = malloc((size_t)K * sizeof(float)), nb = malloc((size_t)K * sizeof(float));
        if (!nw || !nb) {
            free(nw), free(nb);
            return -1;
        }
        for (int64_t k = 0; k < K; k++) nw[k] = get(norm_w, dt, k), nb[k] = norm_b ? get(norm_b, dt, k) : 0.f;
    }
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
            if (nw) {
                float sum = 0.f, sq = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t k = 0; k < K; k++) sum += row[k];
                const float mean = sum / (float)K;
#pragma omp simd reduction(+ : sq)
                for (int64_t k = 0; k < K; k++) sq += (row[k] - mean) * (row[k] - mean);
                const float rstd = 1.f / sqrtf(sq / (float)K + eps);
                if (dt == BF16) {
#pragma omp simd
                    for (int64_t k = 0; k < K; k++) row[k] = round_bf((row[k] - mean) * rstd * nw[k] + nb[k]);
                } else {
#pragma omp simd
                    for (int64_t k = 0; k < K; k++) row[k] = (row[k] - mean) * rstd * nw[k] + nb[k];
                }
            }
            float mn = row[0], mx = row[0];
#pragma omp simd reduction(min : mn) reduction(max : mx)
            for (int64_t k = 0; k < K; k++) {
                mn = row[k] < mn ? row[k] : mn;
                mx = row[k] > mx ? row[k] : mx;
            }
            float s = mx > mn ? (mx - mn) / (float)levels : 1.f, inv = 1.f / s, top = (float)levels;
            uint8_t* q = xq + m * K;
#pragma omp simd
            for (int64_t k = 0; k < K; k++) {
                float v = (row[k] - mn) * inv + 0.5f; /* >= 0.5: truncation rounds to nearest */
                q[k] = (uint8_t)(int32_t)(v < top ? v : top);
            }
            scale[m] = s;
            lo[m] = mn;
        }
        free(row);
    }
    free(nw), free(nb);
    return failed ? -1 : 0;
}

#ifdef QVL_AVX512
/* tanh-GELU(v) = v / (1 + 2^u), u = -2 log2(e) sqrt(2/pi) (v + 0.044715 v^3), with a refined
 * reciprocal (~2^-28) instead of vdivps, whose throughput bound the rescale on the vision
 * tower's fc1; u capped at 64 so that 1 + 2^u stays finite (far negative v: ~1e-19 v where the
 * reference gives 0). */
static inline __m512 gelu_tanh_ps(__m512 v) {
    const __m512 c1 = _mm512_set1_ps(-2.f * 0.7978845608f * 1.4426950409f), c3 = _mm512_set1_ps(0.044715f);
    const __m512 u = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_mul_ps(c3, v), _mm512_mul_ps(v, v), v), c1);
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp2_ps(_mm512_min_ps(u, _mm512_set1_ps(64.f))));
    const __m512 e = _mm512_rcp14_ps(d);
    return _mm512_mul_ps(v, _mm512_mul_ps(e, _mm512_fnmadd_ps(d, e, _mm512_set1_ps(2.f))));
}
#endif

/* v[n] <- tanh-GELU(v[n]) = v / (1 + exp(-2u)), u = sqrt(2/pi) (v + 0.044715 v^3), in float32. */
static void gelu_tanh(float* v, int64_t n) {
    int64_t i = 0;
#ifdef QVL_AVX512
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(v + i, gelu_tanh_ps(_mm512_loadu_ps(v + i)));
#elif defined(QVL_AVX2)
    const __m256 c1 = _mm256_set1_ps(-2.f * 0.7978845608f * 1.4426950409f), c3 = _mm256_set1_ps(0.044715f);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(v + i);
        __m256 u = _mm256_mul_ps(_mm256_fmadd_ps(_mm256_mul_ps(c3, x), _mm256_mul_ps(x, x), x), c1);
        _mm256_storeu_ps(v + i, div_one_plus_exp2_256(x, u));
    }
#endif
    for (; i < n; i++) v[i] = 0.5f * v[i] * (1.f + tanhf(0.7978845608f * (v[i] + 0.044715f * v[i] * v[i] * v[i])));
}

/* y[M][N] (dt) = col_scale[n] * (row_scale[m] * acc[m][n] + row_lo[m] * colsum[n]) (+ bias[n]):
 * the product of rows lo + scale * codes with weights codes * col_scale, from the codes'
 * integer product acc (exact in float32 below 2^24) and the weight codes' sums over K; then
 * tanh-GELU when `gelu` (before the one rounding to dt); then, when `residual` ([M][N], dt) is
 * given, residual + that rounded value, rounded again (as adding the layer's output to the
 * residual stream). Returns 0, or -1 when out of memory. */
int qvl_rescale(const float* acc, const float* row_scale, const float* row_lo, const float* colsum,
                const void* col_scale, const void* bias, int dt, int64_t M, int64_t N, int gelu, const void* residual,
                void* y, int threads) {
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
            const float* a = acc + m * N;
            const float rs = row_scale[m], lo = row_lo[m];
            int64_t done = 0;
#if defined(QVL_AVX512) && defined(__AVX512BF16__)
            if (dt == BF16) { /* one pass in registers: the product, GELU, rounding, residual */
                const __m512 r = _mm512_set1_ps(rs), l = _mm512_set1_ps(lo);
                const uint16_t* res = residual ? (const uint16_t*)residual + m * N : NULL;
                uint16_t* o = (uint16_t*)y + m * N;
                for (; done + 16 <= N; done += 16) {
                    const int64_t n = done;
                    __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(cs + n),
                                               _mm512_add_ps(_mm512_mul_ps(r, _mm512_loadu_ps(a + n)),
                                                             _mm512_mul_ps(l, _mm512_loadu_ps(colsum + n))),
                                               _mm512_loadu_ps(b + n));
                    if (gelu) v = gelu_tanh_ps(v);
                    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
                    if (res)
                        h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(bf16x16_to_ps(h),
                                                                      bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)(res + n)))));
                    _mm256_storeu_si256((__m256i*)(o + n), h);
                }
            }
#endif
            const int64_t rest = N - done;
#pragma omp simd
            for (int64_t n = done; n < N; n++) row[n - done] = cs[n] * (rs * a[n] + lo * colsum[n]) + b[n];
            if (gelu) gelu_tanh(row, rest);
            if (dt == BF16) {
                uint16_t* o = (uint16_t*)y + m * N + done;
                const uint16_t* res = residual ? (const uint16_t*)residual + m * N + done : NULL;
                for (int64_t n = 0; n < rest; n++)
                    o[n] = f32_to_bf16(res ? round_bf(row[n]) + bf16_to_f32(res[n]) : row[n]);
            } else {
                float* o = (float*)y + m * N;
                const float* res = residual ? (const float*)residual + m * N : NULL;
                for (int64_t n = 0; n < N; n++) o[n] = res ? row[n] + res[n] : row[n];
            }
        }
        free(row);
    }
    free(cs), free(b);
    return failed ? -1 : 0;
}
