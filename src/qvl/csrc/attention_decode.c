/* One query per row over the paged KV cache (decoding): AVX512-BF16 for bf16 caches on CPUs
 * that have it; a portable float kernel, vectorised by the compiler for the build's tier, for
 * float32 caches and every other CPU. */
#include "common.h"

#if defined(QVL_AVX512) && defined(__AVX512BF16__) && defined(__AVX512DQ__) /* DQ: exp2_ps3 (every BF16 CPU has it) */
#define QVL_BF16_ATTENTION 1
/* One new query per row against the paged KV cache (decoding), grouped-query: the G = H/Hkv
 * query heads of a key/value head read its keys and values once. q: [B][H][D]; batch row b's
 * position j, head h at table[b*table_stride + j/block]*block_stride + h*head_stride +
 * (j%block)*D; it attends to its first lengths[b] positions; out: [B][H][D]. Scores and
 * softmax in float32. */
static int decode_attention_bf16(const uint16_t* q, const uint16_t* keys, const uint16_t* values,
                                 const int64_t* table, int64_t table_stride, int64_t block, int64_t block_stride,
                                 int64_t head_stride, int64_t B, int64_t H, int64_t Hkv, const int64_t* lengths,
                                 int64_t D, uint16_t* out, int threads) {
    const int64_t G = H / Hkv;
    const float scale2 = 1.4426950408889634f / sqrtf((float)D);
    int failed = 0;
    /* (row, key/value head) items in turn: rows of different lengths (a long image chat beside
     * short text rows) would leave one thread waiting with equal shares */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < B * Hkv; item++) {
        const int64_t b = item / Hkv, h = item % Hkv;
        const uint16_t* kh = keys + h * head_stride;
        const uint16_t* vh = values + h * head_stride;
        const int64_t* tb = table + b * table_stride;
        const int64_t L = lengths[b];
        float* sc = malloc((size_t)(G * L) * sizeof(float));
        if (!sc) {
#pragma omp atomic write
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
            for (int64_t j0 = 0; j0 < L; j0 += block) {
                const uint16_t* kb = kh + tb[j0 / block] * block_stride;
                const int64_t n = L - j0 < block ? L - j0 : block;
                for (int64_t i = 0; i < n; i++) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int c = 0; c < nq; c++)
                        acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(kb + i * D + 32 * c));
                    float v = _mm512_reduce_add_ps(acc) * scale2;
                    sg[j0 + i] = v;
                    top = v > top ? v : top;
                }
            }
            float sum = 0.f;
            int64_t j = 0;
            const __m512 tv = _mm512_set1_ps(top);
            __m512 vsum = _mm512_setzero_ps();
            for (; j + 16 <= L; j += 16) {
                __m512 e = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + j), tv));
                _mm512_storeu_ps(sg + j, e);
                vsum = _mm512_add_ps(vsum, e);
            }
            sum = _mm512_reduce_add_ps(vsum);
            for (; j < L; j++) {
                float e = exp2f(sg[j] - top);
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
        for (int64_t j0 = 0; j0 < L; j0 += block) {
            const uint16_t* vb = vh + tb[j0 / block] * block_stride;
            const int64_t n = L - j0 < block ? L - j0 : block;
            for (int64_t i = 0; i < n; i++) {
                __m512 vr[8];
                for (int c = 0; c < 2 * nq; c++)
                    vr[c] = bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)(vb + i * D + 16 * c)));
                for (int64_t g = 0; g < G; g++) {
                    __m512 pj = _mm512_set1_ps(sc[g * L + j0 + i]);
                    for (int c = 0; c < 2 * nq; c++) acc[g][c] = _mm512_fmadd_ps(pj, vr[c], acc[g][c]);
                }
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
#endif

/* The float kernel for one (row, key/value head): its G query heads over L cached positions
 * in blocks (position j at kh + tb[j/block]*block_stride + (j%block)*D elements, likewise vh),
 * keys and values of dtype dt (constant after inlining, so the inner loops vectorise). */
static inline __attribute__((always_inline)) void decode_head_float(
    const float* qf, const char* kh, const char* vh, const int64_t* tb, int64_t block, int64_t block_stride,
    int64_t G, int64_t L, int64_t D, float scale2, float* sc, float* acc, const int dt) {
    const size_t es = dt == BF16 ? 2 : 4;
    for (int64_t j0 = 0; j0 < L; j0 += block) { /* each key row is read once for the G query heads */
        const char* kb = kh + tb[j0 / block] * block_stride * es;
        const int64_t n = L - j0 < block ? L - j0 : block;
        for (int64_t i = 0; i < n; i++)
            for (int64_t g = 0; g < G; g++) {
                const float* qg = qf + g * D;
                float s = 0.f;
                if (dt == BF16) {
                    const uint16_t* kr = (const uint16_t*)kb + i * D;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; d++) s += qg[d] * bf16_to_f32(kr[d]);
                } else {
                    const float* kr = (const float*)kb + i * D;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; d++) s += qg[d] * kr[d];
                }
                sc[g * L + j0 + i] = s * scale2;
            }
    }
    for (int64_t g = 0; g < G; g++) {
        float* sg = sc + g * L;
        float top = -1e30f;
        for (int64_t j = 0; j < L; j++) top = sg[j] > top ? sg[j] : top;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < L; j++) {
            float e = exp2_poly(sg[j] - top);
            sg[j] = e;
            sum += e;
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t j = 0; j < L; j++) sg[j] *= inv;
    }
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t j0 = 0; j0 < L; j0 += block) {
        const char* vb = vh + tb[j0 / block] * block_stride * es;
        const int64_t n = L - j0 < block ? L - j0 : block;
        for (int64_t i = 0; i < n; i++)
            for (int64_t g = 0; g < G; g++) {
                const float p = sc[g * L + j0 + i];
                float* ag = acc + g * D;
                if (dt == BF16) {
                    const uint16_t* vr = (const uint16_t*)vb + i * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) ag[d] += p * bf16_to_f32(vr[d]);
                } else {
                    const float* vr = (const float*)vb + i * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) ag[d] += p * vr[d];
                }
            }
    }
}

static int decode_attention_float(const void* q, const void* keys, const void* values, int dt, const int64_t* table,
                                  int64_t table_stride, int64_t block, int64_t block_stride, int64_t head_stride,
                                  int64_t B, int64_t H, int64_t Hkv, const int64_t* lengths, int64_t D, void* out,
                                  int threads) {
    const int64_t G = H / Hkv;
    const float scale2 = 1.4426950408889634f / sqrtf((float)D);
    const size_t esize = dt == BF16 ? 2 : 4;
    int failed = 0;
    /* (row, key/value head) items in turn: rows of different lengths (a long image chat beside
     * short text rows) would leave one thread waiting with equal shares */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < B * Hkv; item++) {
        const int64_t b = item / Hkv, h = item % Hkv;
        const char* kh = (const char*)keys + h * head_stride * esize;
        const char* vh = (const char*)values + h * head_stride * esize;
        const int64_t* tb = table + b * table_stride;
        const int64_t L = lengths[b];
        float* buf = malloc((size_t)(G * L + 2 * G * D) * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *sc = buf, *qf = buf + G * L, *acc = qf + G * D;
        for (int64_t i = 0; i < G * D; i++) qf[i] = get(q, dt, (b * H + h * G) * D + i);
        if (dt == BF16)
            decode_head_float(qf, kh, vh, tb, block, block_stride, G, L, D, scale2, sc, acc, BF16);
        else
            decode_head_float(qf, kh, vh, tb, block, block_stride, G, L, D, scale2, sc, acc, F32);
        for (int64_t i = 0; i < G * D; i++) put(out, dt, (b * H + h * G) * D + i, acc[i]);
        free(buf);
    }
    return failed ? -1 : 0;
}

/* One new query per row against the paged KV cache (decoding), grouped-query: the G = H/Hkv
 * query heads of a key/value head read its keys and values once. q: [B][H][D]; batch row b's
 * position j, head h at table[b*table_stride + j/block]*block_stride + h*head_stride +
 * (j%block)*D (elements); it reads its first lengths[b] >= 1 positions only (a row's result
 * does not depend on the other rows); out: [B][H][D]; all of dtype dt. Scores and softmax in
 * float32. Returns 0, -1 when out of memory, -2 for unsupported shapes. */
int qvl_decode_attention(const void* q, const void* keys, const void* values, int dt, const int64_t* table,
                         int64_t table_stride, int64_t block, int64_t block_stride, int64_t head_stride, int64_t B,
                         int64_t H, int64_t Hkv, const int64_t* lengths, int64_t D, void* out, int threads) {
    if (D % 32 != 0 || D > 256 || Hkv < 1 || H % Hkv != 0 || H / Hkv > 16 || block < 1) return -2;
    for (int64_t b = 0; b < B; b++)
        if (lengths[b] < 1) return -2;
#ifdef QVL_BF16_ATTENTION
    if (dt == BF16)
        return decode_attention_bf16(q, keys, values, table, table_stride, block, block_stride, head_stride, B, H,
                                     Hkv, lengths, D, out, threads);
#endif
    return decode_attention_float(q, keys, values, dt, table, table_stride, block, block_stride, head_stride, B, H,
                                  Hkv, lengths, D, out, threads);
}
