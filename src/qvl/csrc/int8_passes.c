/* The passes around oneDNN's int8 GEMM (many rows): activations quantised per row to unsigned
 * codes, and the rescale back to float (tanh-GELU fused into it); and the row-wise layer norm
 * and tanh-GELU that prefill_gemm.c's byte kernel fuses the same way. */
#include "quantise.h"

/* row[0..K) <- LayerNorm(row) as the model's nn.LayerNorm computes it: float32 mean and
 * variance, then (row - mean) * rstd * nw + nb, rounded to dt (nw, nb: float32 [K]). */
void qvl_layer_norm_row(float* row, int64_t K, const float* nw, const float* nb, float eps, int dt) {
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

/* xq[M][K] = x quantised per row to the unsigned codes 0..levels (255; 127 where the GEMM
 * sums exactly only 7-bit activations): x ~= lo[m] + scale[m] * xq, lo the row's minimum.
 * Rows of xq are ldq >= K bytes apart, codes K..ldq-1 zero (the AMX kernel's padding).
 * With norm_w (dt [K], and norm_b or NULL): each row is first layer-normalised as the model's
 * LayerNorm does (float32 mean and variance, the result rounded to dt), so the normalised rows
 * are never written. Returns 0, or -1 when out of memory. */
int qvl_quantize_rows(const void* x, int dt, int64_t M, int64_t K, int levels, const void* norm_w, const void* norm_b,
                      float eps, uint8_t* xq, int64_t ldq, float* scale, float* lo, int threads) {
    float *nw = NULL, *nb = NULL;
    if (norm_w && qvl_rescale_columns(norm_w, norm_b, dt, K, &nw, &nb)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float* row = malloc((size_t)K * sizeof(float));
        if (!row) failed = 1;
#pragma omp for schedule(dynamic, 4)
        for (int64_t m = 0; m < M; m++) {
            if (!row) continue;
            if (dt == BF16) {
                const uint16_t* xr = (const uint16_t*)x + m * K;
                int64_t k = 0;
#ifdef QVL_AVX512
                for (; k + 16 <= K; k += 16)
                    _mm512_storeu_ps(row + k, bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)(xr + k))));
#endif
                for (; k < K; k++) row[k] = bf16_to_f32(xr[k]);
            } else {
                memcpy(row, (const float*)x + m * K, (size_t)K * sizeof(float));
            }
            if (nw) qvl_layer_norm_row(row, K, nw, nb, eps, dt);
            row_codes_u8(row, K, levels, xq + m * ldq, ldq, scale + m, lo + m);
        }
        free(row);
    }
    free(nw);
    return failed ? -1 : 0;
}


/* v[n] <- tanh-GELU(v[n]) = v / (1 + exp(-2u)), u = sqrt(2/pi) (v + 0.044715 v^3), in float32. */
void qvl_gelu_tanh(float* v, int64_t n) {
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
#elif defined(QVL_NEON) /* the AVX2 steps (the byte kernel's fused GELU on ARM: not one tanhf per value) */
    const float32x4_t c1 = vdupq_n_f32(-2.f * 0.7978845608f * 1.4426950409f), c3 = vdupq_n_f32(0.044715f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t x = vld1q_f32(v + i);
        const float32x4_t u = vmulq_f32(vfmaq_f32(x, vmulq_f32(c3, x), vmulq_f32(x, x)), c1);
        vst1q_f32(v + i, vdivq_f32(x, vaddq_f32(vdupq_n_f32(1.f), exp2_f32x4(u))));
    }
#endif
    for (; i < n; i++) v[i] = 0.5f * v[i] * (1.f + tanhf(0.7978845608f * (v[i] + 0.044715f * v[i] * v[i] * v[i])));
}

/* One row of the rescale: y[n] (dt) = cs[n] * (rs * a[n] + lo * colsum[n]) + b[n] for n < N,
 * then tanh-GELU when `gelu` (before the one rounding to dt), then, when `res` is given (N
 * values of dt), res[n] + that rounded value, rounded again. cs, b: float32 [N]; tmp: N floats
 * of scratch. The same operations whichever caller passes the row (qvl_rescale's whole rows, or
 * the AMX kernel's 16- and 32-column blocks): vectors of 16, the scalar tail. */
void qvl_rescale_row(const float* a, float rs, float lo, const float* colsum, const float* cs, const float* b, int dt,
                     int64_t N, int gelu, const void* res, void* y, float* tmp) {
    int64_t done = 0;
#if defined(QVL_AVX512) && defined(__AVX512BF16__)
    if (dt == BF16) { /* one pass in registers: the product, GELU, rounding, residual */
        const __m512 r = _mm512_set1_ps(rs), l = _mm512_set1_ps(lo);
        const uint16_t* rb = (const uint16_t*)res;
        uint16_t* o = (uint16_t*)y;
        for (; done + 16 <= N; done += 16)
            rescale16_bf16(_mm512_loadu_ps(a + done), r, l, _mm512_loadu_ps(cs + done), _mm512_loadu_ps(colsum + done),
                           _mm512_loadu_ps(b + done), gelu, rb ? rb + done : NULL, o + done);
    }
#endif
    const int64_t rest = N - done;
#pragma omp simd
    for (int64_t n = done; n < N; n++) tmp[n - done] = cs[n] * (rs * a[n] + lo * colsum[n]) + b[n];
    if (gelu) qvl_gelu_tanh(tmp, rest);
    if (dt == BF16) {
        uint16_t* o = (uint16_t*)y + done;
        const uint16_t* rb = res ? (const uint16_t*)res + done : NULL;
        for (int64_t n = 0; n < rest; n++) o[n] = f32_to_bf16(rb ? round_bf(tmp[n]) + bf16_to_f32(rb[n]) : tmp[n]);
    } else {
        float* o = (float*)y + done;
        const float* rf = res ? (const float*)res + done : NULL;
        for (int64_t n = 0; n < rest; n++) o[n] = rf ? tmp[n] + rf[n] : tmp[n];
    }
}

/* col_scale and bias (dt [N]; col_scale NULL: ones, bias NULL: zeros) as float32 arrays, for qvl_rescale_row
 * (and a layer norm's weight and bias the same way); -1 when out of memory (free with
 * free(*cs); *b is in the same block). */
int qvl_rescale_columns(const void* col_scale, const void* bias, int dt, int64_t N, float** cs, float** b) {
    *cs = malloc((size_t)(2 * N) * sizeof(float));
    if (!*cs) return -1;
    *b = *cs + N;
    for (int64_t n = 0; n < N; n++) {
        (*cs)[n] = col_scale ? get(col_scale, dt, n) : 1.f;
        (*b)[n] = bias ? get(bias, dt, n) : 0.f;
    }
    return 0;
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
    float *cs, *b;
    if (qvl_rescale_columns(col_scale, bias, dt, N, &cs, &b)) return -1;
    const size_t es = dt == BF16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float* row = malloc((size_t)N * sizeof(float));
        if (!row) failed = 1;
#pragma omp for schedule(dynamic, 4)
        for (int64_t m = 0; m < M; m++) {
            if (!row) continue;
            qvl_rescale_row(acc + m * N, row_scale[m], row_lo[m], colsum, cs, b, dt, N, gelu,
                            residual ? (const char*)residual + m * N * es : NULL, (char*)y + m * N * es, row);
        }
        free(row);
    }
    free(cs);
    return failed ? -1 : 0;
}
