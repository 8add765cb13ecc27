/* Element-wise kernels: RMSNorm, SiLU . mul, and the text and vision rotary embeddings, rounded
 * as the reference modules round them. */
#include "common.h"

/* RMSNorm of rows as the reference computes it: float32 mean of squares, x * rsqrt(mean +
 * eps) rounded to dt, times the weight, rounded again. x, w, out: dtype dt; x [rows][dim]. */
void qvl_rmsnorm(const void* x, const void* w, void* out, int dt, int64_t rows, int64_t dim, float eps,
                 int threads) {
#pragma omp parallel for num_threads(rows >= 64 ? threads : 1) schedule(dynamic, 16)
    for (int64_t r = 0; r < rows; r++) {
        float ss = 0.f;
        if (dt == BF16) {
            const uint16_t* xr = (const uint16_t*)x + r * dim;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) ss += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
            const float inv = 1.f / sqrtf(ss / (float)dim + eps);
            const uint16_t* wr = (const uint16_t*)w;
            uint16_t* o = (uint16_t*)out + r * dim;
            for (int64_t i = 0; i < dim; i++)
                o[i] = f32_to_bf16(bf16_to_f32(wr[i]) * round_bf(bf16_to_f32(xr[i]) * inv));
        } else {
            const float* xr = (const float*)x + r * dim;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
            const float inv = 1.f / sqrtf(ss / (float)dim + eps);
            const float* wr = (const float*)w;
            float* o = (float*)out + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) o[i] = wr[i] * (xr[i] * inv);
        }
    }
}

/* RMSNorm scaling by (1 + w) (Qwen3.5): x * rsqrt(mean x^2 + eps) * (1 + w) in float32, rounded
 * once (out may be x). */
void qvl_rmsnorm_zero_centred(const void* x, const void* w, void* out, int dt, int64_t rows, int64_t dim, float eps,
                              int threads) {
#pragma omp parallel for num_threads(rows >= 64 ? threads : 1) schedule(dynamic, 16)
    for (int64_t r = 0; r < rows; r++) {
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += get(x, dt, r * dim + i) * get(x, dt, r * dim + i);
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) put(out, dt, r * dim + i, get(x, dt, r * dim + i) * inv * (1.f + get(w, dt, i)));
    }
}

/* Gated RMSNorm of the Gated DeltaNet's output (Qwen3.5), per row of dim: n = w * round(x *
 * rsqrt(mean x^2 + eps)) rounded, then n * silu(z) in float32, rounded once, as the reference
 * module rounds (out may be x). x, z, out: [rows][dim]; w: [dim]; all of dtype dt. */
void qvl_gated_rmsnorm(const void* x, const void* z, const void* w, void* out, int dt, int64_t rows, int64_t dim,
                       float eps, int threads) {
#pragma omp parallel for num_threads(rows >= 64 ? threads : 1) schedule(dynamic, 16)
    for (int64_t r = 0; r < rows; r++) {
#if defined(QVL_AVX512) && defined(__AVX512BF16__)
        if (dt == BF16 && dim % 16 == 0) {
            const uint16_t *xr = (const uint16_t*)x + r * dim, *zr = (const uint16_t*)z + r * dim,
                           *wr = (const uint16_t*)w;
            uint16_t* o = (uint16_t*)out + r * dim;
#define LD(p) bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)(p)))
#define RB(v) bf16x16_to_ps((__m256i)_mm512_cvtneps_pbh(v))
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < dim; i += 16) acc = _mm512_fmadd_ps(LD(xr + i), LD(xr + i), acc);
            const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
            for (int64_t i = 0; i < dim; i += 16) {
                const __m512 n = RB(_mm512_mul_ps(LD(wr + i), RB(_mm512_mul_ps(LD(xr + i), inv))));
                const __m512 g = LD(zr + i);
                const __m512 s = div_one_plus_exp2(g, _mm512_mul_ps(g, _mm512_set1_ps(-1.4426950408889634f)));
                _mm256_storeu_si256((__m256i*)(o + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(n, s)));
            }
#undef LD
#undef RB
            continue;
        }
#endif
        float ss = 0.f;
        for (int64_t i = 0; i < dim; i++) ss += get(x, dt, r * dim + i) * get(x, dt, r * dim + i);
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) {
            const float n = in_dt(get(w, dt, i) * in_dt(get(x, dt, r * dim + i) * inv, dt), dt), g = get(z, dt, r * dim + i);
            put(out, dt, r * dim + i, n * (g / (1.f + expf(-g))));
        }
    }
}

/* Rotary embedding of `heads` rows of D in place: x*cos + rotate_half(x)*sin, in bf16 with
 * each product and the sum rounded as the reference does, in float32 exactly as written. */
void qvl_text_rope_rows(void* x, int dt, int64_t heads, int64_t D, const void* cos, const void* sin) {
    const int64_t half = D / 2;
    float t[256];
    for (int64_t r = 0; r < heads; r++) {
        for (int64_t i = 0; i < D; i++) t[i] = get(x, dt, r * D + i);
        for (int64_t i = 0; i < D; i++) {
            float rot = i < half ? -t[i + half] : t[i - half];
            float a = t[i] * get(cos, dt, i), b = rot * get(sin, dt, i);
            put(x, dt, r * D + i, dt == BF16 ? round_bf(a) + round_bf(b) : a + b);
        }
    }
}

/* g <- silu(g) * u, rounded (in bf16) after silu and after the product: the decode step's
 * SwiGLU, and prefill's in bf16 (the plan's silu_mul, qvl/kernels/plan.py). */
void qvl_silu_mul(void* g, const void* u, int dt, int64_t n, int threads) {
#pragma omp parallel for num_threads(n >= 4096 ? threads : 1) schedule(dynamic, 16)
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
        const int64_t end = i0 + 256 < n ? i0 + 256 : n;
        int64_t i = i0;
#if defined(QVL_AVX512) && defined(__AVX512BF16__)
        if (dt == BF16) {
            uint16_t* gb = (uint16_t*)g;
            const uint16_t* ub = (const uint16_t*)u;
            for (; i + 16 <= end; i += 16) {
                const __m512 x = bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)(gb + i)));
                const __m512 s = div_one_plus_exp2(x, _mm512_mul_ps(x, _mm512_set1_ps(-1.4426950408889634f)));
                const __m512 sr = bf16x16_to_ps((__m256i)_mm512_cvtneps_pbh(s));
                const __m512 y = _mm512_mul_ps(sr, bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)(ub + i))));
                _mm256_storeu_si256((__m256i*)(gb + i), (__m256i)_mm512_cvtneps_pbh(y));
            }
        }
#endif
        for (; i < end; i++) {
            float x = get(g, dt, i), s = x / (1.f + expf(-x));
            put(g, dt, i, (dt == BF16 ? round_bf(s) : s) * get(u, dt, i));
        }
    }
}

/* Prefill's rotary embedding: out[t][h] = x[t][h] * cos[t] + rotate_half(x[t][h]) * sin[t] for
 * T tokens of H heads of D (x at t * x_tok + h * x_head, D contiguous; cos/sin [T][D]; out
 * [T][H][D]), rounded as the reference rounds it in bf16 (each product, then the sum), as the
 * decode step's qvl_text_rope_rows does. Returns 0, or -2 for D odd or above 256. */
int qvl_text_rope(const void* x, int dt, int64_t T, int64_t H, int64_t D, int64_t x_tok, int64_t x_head,
                  const void* cos, const void* sin, void* out, int threads) {
    if (D % 2 || D > 256) return -2; /* qvl_text_rope_rows' row buffer */
    const size_t es = dt == BF16 ? 2 : 4;
#pragma omp parallel for num_threads(T * H >= 64 ? threads : 1) schedule(dynamic, 4)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            char* o = (char*)out + ((t * H + h) * D) * es;
            const char* xr = (const char*)x + (t * x_tok + h * x_head) * es;
#if defined(QVL_AVX512) && defined(__AVX512BF16__)
            if (dt == BF16 && D % 32 == 0) {
                const int64_t half = D / 2;
                const uint16_t *xb = (const uint16_t*)xr, *cb = (const uint16_t*)cos + t * D,
                               *sb = (const uint16_t*)sin + t * D;
                uint16_t* ob = (uint16_t*)o;
#define LD(p) bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)(p)))
#define RB(v) bf16x16_to_ps((__m256i)_mm512_cvtneps_pbh(v))
                for (int64_t i = 0; i < half; i += 16) {
                    const __m512 x1 = LD(xb + i), x2 = LD(xb + half + i);
                    const __m512 neg2 = _mm512_castsi512_ps(  /* -x2 as the reference negates: -0 for +0 */
                        _mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32((int)0x80000000)));
                    const __m512 lo = _mm512_add_ps(RB(_mm512_mul_ps(x1, LD(cb + i))), RB(_mm512_mul_ps(neg2, LD(sb + i))));
                    const __m512 hi = _mm512_add_ps(RB(_mm512_mul_ps(x2, LD(cb + half + i))),
                                                    RB(_mm512_mul_ps(x1, LD(sb + half + i))));
                    _mm256_storeu_si256((__m256i*)(ob + i), (__m256i)_mm512_cvtneps_pbh(lo));
                    _mm256_storeu_si256((__m256i*)(ob + half + i), (__m256i)_mm512_cvtneps_pbh(hi));
                }
#undef LD
#undef RB
                continue;
            }
#endif
            memcpy(o, xr, (size_t)D * es);
            qvl_text_rope_rows(o, dt, 1, D, (const char*)cos + t * D * es, (const char*)sin + t * D * es);
        }
    return 0;
}

#if defined(QVL_AVX512) && defined(__AVX512BF16__) && defined(__AVX512DQ__) /* DQ: exp2_ps3 (every BF16 CPU has it) */
/* Rotary embedding of the vision tower's q or k, as the reference computes it: in float32,
 * x*cos + rotate_half(x)*sin (two products and a sum, each rounded: the explicit-rounding
 * intrinsics keep the compiler from fusing them into one FMA), rounded once to bf16.
 * x: bf16, row n head h at n*tok + h*head (D contiguous); cos/sin: [N][D] float32;
 * out: [N][H][D] bf16. Any even D (the last 16 lanes of each half masked). Returns 0, or -2
 * when D is odd. */
int qvl_vision_rope(const uint16_t* x, int64_t tok, int64_t head, int64_t N, int64_t H, int64_t D, const float* cos,
                    const float* sin, uint16_t* out, int threads) {
    if (D % 2 != 0) return -2;
    const int64_t half = D / 2; /* rotate_half pairs column j with j + half; 16 lanes at a time, the last masked */
#define rn (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) /* a constant expression, as clang requires */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos + n * D, *s = sin + n * D;
        for (int64_t h = 0; h < H; h++) {
            const uint16_t* xr = x + n * tok + h * head;
            uint16_t* o = out + (n * H + h) * D;
            for (int64_t i = 0; i < half; i += 16) {
                const __mmask16 m = half - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (half - i)) - 1);
                const __m512 a = bf16x16_to_ps(_mm256_maskz_loadu_epi16(m, xr + i));
                const __m512 b = bf16x16_to_ps(_mm256_maskz_loadu_epi16(m, xr + half + i));
                /* first half: a cos - b sin; second: b cos + a sin (each product rounded, then the sum) */
                const __m512 y1 = _mm512_add_round_ps(_mm512_mul_round_ps(a, _mm512_maskz_loadu_ps(m, c + i), rn),
                                                      _mm512_mul_round_ps(_mm512_sub_ps(_mm512_setzero_ps(), b),
                                                                          _mm512_maskz_loadu_ps(m, s + i), rn), rn);
                const __m512 y2 = _mm512_add_round_ps(_mm512_mul_round_ps(b, _mm512_maskz_loadu_ps(m, c + half + i), rn),
                                                      _mm512_mul_round_ps(a, _mm512_maskz_loadu_ps(m, s + half + i), rn),
                                                      rn);
                _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(y1));
                _mm256_mask_storeu_epi16(o + half + i, m, (__m256i)_mm512_cvtneps_pbh(y2));
            }
        }
    }
    return 0;
}
#undef rn
#else
int qvl_vision_rope(const uint16_t* x, int64_t tok, int64_t head, int64_t N, int64_t H, int64_t D, const float* cos,
                    const float* sin, uint16_t* out, int threads) {
    (void)x, (void)tok, (void)head, (void)N, (void)H, (void)D, (void)cos, (void)sin, (void)out, (void)threads;
    return -2;
}
#endif
