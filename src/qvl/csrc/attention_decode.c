/* One query per row over the paged KV cache (decoding): AVX512-BF16 for bf16 caches on CPUs
 * that have it; a portable float kernel, vectorised by the compiler for the build's tier, for
 * float32 caches and every other CPU. */
#include "team.h"

#if defined(QVL_AVX512) && defined(__AVX512BF16__) && defined(__AVX512DQ__) /* DQ: exp2_ps3 (every BF16 CPU has it) */
#define QVL_BF16_ATTENTION 1
/* Item (b, h) = b * Hkv + h of the decode attention: row b's G = H/Hkv query heads of key/value
 * head h over its positions, the keys and values read once for the G heads; their outputs as
 * float32 in acc [G][D] (rounded to bf16 when committed). Scores and softmax in float32. */
static int bf16_item(const QvlAttention* a, int64_t item, float* acc_out) {
    const int64_t G = a->H / a->Hkv, D = a->D, H = a->H, block = a->block, block_stride = a->block_stride;
    const float scale2 = 1.4426950408889634f / sqrtf((float)D);
    const uint16_t* q = (const uint16_t*)a->q;
    const int64_t b = item / a->Hkv, h = item % a->Hkv;
    const uint16_t* kh = (const uint16_t*)a->keys + h * a->head_stride;
    const uint16_t* vh = (const uint16_t*)a->values + h * a->head_stride;
    const int64_t* tb = a->table + b * a->table_stride;
    const int64_t L = a->lengths[b];
    float* sc = malloc((size_t)(G * L) * sizeof(float));
    if (!sc) return -1;
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
    for (int64_t g = 0; g < G; g++)
        for (int c = 0; c < 2 * nq; c++) _mm512_storeu_ps(acc_out + g * D + 16 * c, acc[g][c]);
    free(sc);
    return 0;
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

/* Item (b, h) of the decode attention in the float kernel: acc [G][D] as bf16_item. */
static int float_item(const QvlAttention* a, int64_t item, float* acc) {
    const int64_t G = a->H / a->Hkv, D = a->D, b = item / a->Hkv, h = item % a->Hkv;
    const float scale2 = 1.4426950408889634f / sqrtf((float)D);
    const size_t esize = a->dt == BF16 ? 2 : 4;
    const char* kh = (const char*)a->keys + h * a->head_stride * esize;
    const char* vh = (const char*)a->values + h * a->head_stride * esize;
    const int64_t* tb = a->table + b * a->table_stride;
    const int64_t L = a->lengths[b];
    float* buf = malloc((size_t)(G * L + G * D) * sizeof(float));
    if (!buf) return -1;
    float *sc = buf, *qf = buf + G * L;
    for (int64_t i = 0; i < G * D; i++) qf[i] = get(a->q, a->dt, (b * a->H + h * G) * D + i);
    if (a->dt == BF16)
        decode_head_float(qf, kh, vh, tb, a->block, a->block_stride, G, L, D, scale2, sc, acc, BF16);
    else
        decode_head_float(qf, kh, vh, tb, a->block, a->block_stride, G, L, D, scale2, sc, acc, F32);
    free(buf);
    return 0;
}

static int attention_run(const void* ctx, const TeamItem* it) {
    const QvlAttention* a = (const QvlAttention*)ctx;
#ifdef QVL_BF16_ATTENTION
    if (a->dt == BF16) return bf16_item(a, it->index, it->own);
#endif
    return float_item(a, it->index, it->own);
}

static void attention_commit(const void* ctx, const TeamItem* it) {
    const QvlAttention* a = (const QvlAttention*)ctx;
    const int64_t G = a->H / a->Hkv, b = it->index / a->Hkv, h = it->index % a->Hkv;
    for (int64_t i = 0; i < G * a->D; i++) put(a->out, a->dt, (b * a->H + h * G) * a->D + i, it->own[i]);
}

/* Whether the kernel takes the shapes: head size a multiple of 32 up to 256, up to 16 query heads
 * per key/value head, every row with a position. */
int qvl_decode_attention_fits(const QvlAttention* a) {
    if (a->D % 32 != 0 || a->D > 256 || a->Hkv < 1 || a->H % a->Hkv != 0 || a->H / a->Hkv > 16 || a->block < 1)
        return 0;
    for (int64_t b = 0; b < a->B; b++)
        if (a->lengths[b] < 1) return 0;
    return 1;
}

/* The decode attention as a takeover job: (row, key/value head) items in turn (rows of different
 * lengths, a long image chat beside short text rows, would leave one thread waiting with equal
 * shares), each head group's outputs computed into a thread's own buffer (G * D floats). */
TeamJob qvl_decode_attention_job(const QvlAttention* a) {
    return (TeamJob){a->B * a->Hkv, 1, attention_run, attention_commit, a};
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
    const QvlAttention a = {q, keys, values, dt, table, table_stride, block, block_stride, head_stride, B, H, Hkv,
                            lengths, D, out};
    if (!qvl_decode_attention_fits(&a)) return -2;
    const TeamJob job = qvl_decode_attention_job(&a);
    return team_region(threads, job.items, (H / Hkv) * D, team_one_job, &job, NULL) ? -1 : 0;
}
