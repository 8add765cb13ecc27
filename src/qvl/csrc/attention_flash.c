/* Attention: flash attention for the vision tower and causal prefill (AVX512-BF16), the
 * vision tower's RoPE, and one query per row over the KV cache for decoding (AVX512-BF16 for
 * bf16 caches on CPUs that have it; a portable float kernel, vectorised by the compiler for
 * the build's tier, for float32 caches and every other CPU). */
#include "common.h"

#if defined(QVL_AVX512) && defined(__AVX512VNNI__)
/* The loops in assembly, accumulators in zmm0-19 from zero, stored to `out` ([4][nv][16]
 * int32) at the end: GCC 12 spills or copies the C loops' 16-20 zmm accumulators once per
 * step, as it copied the AVX2 loop's. Per step: nv vectors of b (b_step bytes apart per step),
 * the 4 rows' words of a (a_row bytes apart) broadcast, 4 x nv `op`: vpdpwssd (16-bit pairs,
 * qvl_attention_i16) or vpdpbusd (unsigned bytes of a, signed bytes of b: qvl_attention_q8). */
#define ZERO(r) "vpxord %%zmm" #r ", %%zmm" #r ", %%zmm" #r "\n\t"
#define STORE(r, i) "vmovdqu32 %%zmm" #r ", " #i "*64(%[out])\n\t"
#define LOOP_HEAD "1:\n\t" \
    "vpbroadcastd (%[a]), %%zmm28\n\t" "vpbroadcastd (%[a], %[ar]), %%zmm29\n\t" \
    "vpbroadcastd (%[a2]), %%zmm30\n\t" "vpbroadcastd (%[a2], %[ar]), %%zmm31\n\t"
#define LOOP_TAIL "add $4, %[a]\n\t" "add $4, %[a2]\n\t" "add %[bs], %[b]\n\t" "dec %[n]\n\t" "jnz 1b\n\t"
/* vector v (register zmm2x) against the 4 rows: accumulators r, r + nv, r + 2 nv, r + 3 nv */
#define ROWS4(op, v, r0, r1, r2, r3) op " %%zmm" v ", %%zmm28, %%zmm" #r0 "\n\t" \
    op " %%zmm" v ", %%zmm29, %%zmm" #r1 "\n\t" op " %%zmm" v ", %%zmm30, %%zmm" #r2 "\n\t" \
    op " %%zmm" v ", %%zmm31, %%zmm" #r3 "\n\t"
#define CLOBBER4 "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
    "xmm12", "xmm13", "xmm14", "xmm15", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", \
    "xmm31", "memory", "cc"

#define PRODUCTS(name4, name5, op) \
/* 4 rows x 4 vectors: out[i][v] (16 int32 each). volatile: the stores to out are its only effect */ \
static inline void name4(const uint32_t* a, int64_t a_row, const uint32_t* b, int64_t b_step, int64_t n, \
                         int32_t* out) { \
    const char* a2 = (const char*)a + 2 * a_row; \
    __asm__ volatile(ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5) ZERO(6) ZERO(7) \
            ZERO(8) ZERO(9) ZERO(10) ZERO(11) ZERO(12) ZERO(13) ZERO(14) ZERO(15) \
            LOOP_HEAD \
            "vmovdqu32 (%[b]), %%zmm24\n\t" "vmovdqu32 64(%[b]), %%zmm25\n\t" \
            "vmovdqu32 128(%[b]), %%zmm26\n\t" "vmovdqu32 192(%[b]), %%zmm27\n\t" \
            ROWS4(op, "24", 0, 4, 8, 12) ROWS4(op, "25", 1, 5, 9, 13) ROWS4(op, "26", 2, 6, 10, 14) \
            ROWS4(op, "27", 3, 7, 11, 15) \
            LOOP_TAIL \
            STORE(0, 0) STORE(1, 1) STORE(2, 2) STORE(3, 3) STORE(4, 4) STORE(5, 5) STORE(6, 6) STORE(7, 7) \
            STORE(8, 8) STORE(9, 9) STORE(10, 10) STORE(11, 11) STORE(12, 12) STORE(13, 13) STORE(14, 14) \
            STORE(15, 15) \
            : [a] "+r"(a), [a2] "+r"(a2), [b] "+r"(b), [n] "+r"(n) \
            : [ar] "r"(a_row), [bs] "r"(b_step), [out] "r"(out) \
            : CLOBBER4); \
} \
 \
/* 4 rows x 5 vectors, the fifth masked: out[i][v] (16 int32 each) */ \
static inline void name5(const uint32_t* a, int64_t a_row, const uint32_t* b, int64_t b_step, int64_t n, \
                         __mmask16 last, int32_t* out) { \
    const char* a2 = (const char*)a + 2 * a_row; \
    __asm__ volatile(ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5) ZERO(6) ZERO(7) ZERO(8) ZERO(9) \
            ZERO(10) ZERO(11) ZERO(12) ZERO(13) ZERO(14) ZERO(15) ZERO(16) ZERO(17) ZERO(18) ZERO(19) \
            LOOP_HEAD \
            "vmovdqu32 (%[b]), %%zmm23\n\t" "vmovdqu32 64(%[b]), %%zmm24\n\t" \
            "vmovdqu32 128(%[b]), %%zmm25\n\t" "vmovdqu32 192(%[b]), %%zmm26\n\t" \
            "vmovdqu32 256(%[b]), %%zmm27%{%[m]%}%{z%}\n\t" \
            ROWS4(op, "23", 0, 5, 10, 15) ROWS4(op, "24", 1, 6, 11, 16) ROWS4(op, "25", 2, 7, 12, 17) \
            ROWS4(op, "26", 3, 8, 13, 18) \
            ROWS4(op, "27", 4, 9, 14, 19) \
            LOOP_TAIL \
            STORE(0, 0) STORE(1, 1) STORE(2, 2) STORE(3, 3) STORE(4, 4) STORE(5, 5) STORE(6, 6) STORE(7, 7) \
            STORE(8, 8) STORE(9, 9) STORE(10, 10) STORE(11, 11) STORE(12, 12) STORE(13, 13) STORE(14, 14) \
            STORE(15, 15) STORE(16, 16) STORE(17, 17) STORE(18, 18) STORE(19, 19) \
            : [a] "+r"(a), [a2] "+r"(a2), [b] "+r"(b), [n] "+r"(n) \
            : [ar] "r"(a_row), [bs] "r"(b_step), [out] "r"(out), [m] "Yk"(last) \
            : CLOBBER4, "xmm16", "xmm17", "xmm18", "xmm19"); \
}
PRODUCTS(products_4x4, products_4x5, "vpdpwssd")
#ifdef __AVX512BF16__
PRODUCTS(bytes_4x4, bytes_4x5, "vpdpbusd")
#endif
#endif

#if defined(QVL_AVX512) && defined(__AVX512BF16__) && defined(__AVX512DQ__) /* DQ: exp2_ps3 (every BF16 CPU has it) */
#define QVL_BF16_ATTENTION 1
#define ABK 64 /* keys per step */
#define ATQ 4  /* query rows per tile (ATQ x ABK/16 score accumulators) */
#define ABQ 64 /* query rows per block (its keys and values stay in L1 across the tiles) */
#define NKB (ABK / 16)
#define MAX_SLACK 8.f /* log2 units */

#ifdef __AVX512VNNI__
#define QVL_BYTE_SCORES 1
#endif
/* One head's keys and values in 8-bit codes for qvl_attention_q8. Keys: minus their mean over
 * the image (softmax does not see a constant per query row), one step per block of ABK keys;
 * kq [D/4][S_pad]: a key's codes of dimensions 4g..4g+3 in one word (vpdpbusd's signed
 * operand); corr [S_pad]: -128 x the sum of the key's codes (the queries enter as unsigned
 * codes + 128); step [S_pad/ABK]. Values: a step per channel and block of ABK keys, vstep
 * [S_pad/ABK][DV]; vq [S_pad/4][DV]: channel d of keys 4u..4u+3 in one word. Past S: codes 0. */
typedef struct {
    const uint32_t* kq;
    const int32_t* corr;
    const float* step;
    const uint32_t* vq;
    const float* vstep;
} ByteScores;

#ifdef QVL_BYTE_SCORES
/* Codes of 16 floats: x * inv rounded half away from zero (as round_int), int32. */
static inline __m512i codes16(__m512 x, __m512 inv) {
    const __m512 y = _mm512_mul_ps(x, inv);
    const __m512 half = _mm512_or_ps(_mm512_and_ps(y, _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u))),
                                     _mm512_set1_ps(0.5f));
    return _mm512_cvttps_epi32(_mm512_add_ps(y, half));
}

/* Lanes 0..n of D bf16 values (n < 16 masked, zeros past) as floats. */
static inline __m512 load16_bf16(const uint16_t* x, int64_t n) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    return bf16x16_to_ps(_mm256_maskz_loadu_epi16(m, x));
}

/* out[i][b] (16 int32) = corr[16b..16b+15] + the byte products of query row i's codes (rows D
 * bytes apart from q, a word of 4 per group) with keys 16b..16b+15 (k: a row of words per group,
 * k_step bytes apart), over n groups: 16 vpdpbusd per group. In assembly, accumulators in
 * zmm0-15: GCC's loop copied every accumulator twice per group and spilled some (the scores ran
 * at half the instruction's rate). */
static inline __attribute__((always_inline)) void byte_scores(int32_t out[ATQ][NKB][16], const int32_t* corr,
                                                              const char* k, int64_t k_step, const char* q, int64_t D,
                                                              int64_t n) {
    const int64_t D3 = 3 * D;
    __asm__ volatile(
        "vmovdqu64 (%[c]), %%zmm0\n\t"
        "vmovdqu64 64(%[c]), %%zmm1\n\t"
        "vmovdqu64 128(%[c]), %%zmm2\n\t"
        "vmovdqu64 192(%[c]), %%zmm3\n\t"
        "vmovdqa64 %%zmm0, %%zmm4\n\t"
        "vmovdqa64 %%zmm1, %%zmm5\n\t"
        "vmovdqa64 %%zmm2, %%zmm6\n\t"
        "vmovdqa64 %%zmm3, %%zmm7\n\t"
        "vmovdqa64 %%zmm0, %%zmm8\n\t"
        "vmovdqa64 %%zmm1, %%zmm9\n\t"
        "vmovdqa64 %%zmm2, %%zmm10\n\t"
        "vmovdqa64 %%zmm3, %%zmm11\n\t"
        "vmovdqa64 %%zmm0, %%zmm12\n\t"
        "vmovdqa64 %%zmm1, %%zmm13\n\t"
        "vmovdqa64 %%zmm2, %%zmm14\n\t"
        "vmovdqa64 %%zmm3, %%zmm15\n\t"
        "1:\n\t"
        "vmovdqu64 (%[k]), %%zmm16\n\t"
        "vmovdqu64 64(%[k]), %%zmm17\n\t"
        "vmovdqu64 128(%[k]), %%zmm18\n\t"
        "vmovdqu64 192(%[k]), %%zmm19\n\t"
        "vpbroadcastd (%[q]), %%zmm20\n\t"
        "vpbroadcastd (%[q],%[D]), %%zmm21\n\t"
        "vpbroadcastd (%[q],%[D],2), %%zmm22\n\t"
        "vpbroadcastd (%[q],%[D3]), %%zmm23\n\t"
        "vpdpbusd %%zmm16, %%zmm20, %%zmm0\n\t"
        "vpdpbusd %%zmm17, %%zmm20, %%zmm1\n\t"
        "vpdpbusd %%zmm18, %%zmm20, %%zmm2\n\t"
        "vpdpbusd %%zmm19, %%zmm20, %%zmm3\n\t"
        "vpdpbusd %%zmm16, %%zmm21, %%zmm4\n\t"
        "vpdpbusd %%zmm17, %%zmm21, %%zmm5\n\t"
        "vpdpbusd %%zmm18, %%zmm21, %%zmm6\n\t"
        "vpdpbusd %%zmm19, %%zmm21, %%zmm7\n\t"
        "vpdpbusd %%zmm16, %%zmm22, %%zmm8\n\t"
        "vpdpbusd %%zmm17, %%zmm22, %%zmm9\n\t"
        "vpdpbusd %%zmm18, %%zmm22, %%zmm10\n\t"
        "vpdpbusd %%zmm19, %%zmm22, %%zmm11\n\t"
        "vpdpbusd %%zmm16, %%zmm23, %%zmm12\n\t"
        "vpdpbusd %%zmm17, %%zmm23, %%zmm13\n\t"
        "vpdpbusd %%zmm18, %%zmm23, %%zmm14\n\t"
        "vpdpbusd %%zmm19, %%zmm23, %%zmm15\n\t"
        "add %[ks], %[k]\n\t"
        "add $4, %[q]\n\t"
        "dec %[n]\n\t"
        "jnz 1b\n\t"
        "vmovdqu64 %%zmm0, (%[o])\n\t"
        "vmovdqu64 %%zmm1, 64(%[o])\n\t"
        "vmovdqu64 %%zmm2, 128(%[o])\n\t"
        "vmovdqu64 %%zmm3, 192(%[o])\n\t"
        "vmovdqu64 %%zmm4, 256(%[o])\n\t"
        "vmovdqu64 %%zmm5, 320(%[o])\n\t"
        "vmovdqu64 %%zmm6, 384(%[o])\n\t"
        "vmovdqu64 %%zmm7, 448(%[o])\n\t"
        "vmovdqu64 %%zmm8, 512(%[o])\n\t"
        "vmovdqu64 %%zmm9, 576(%[o])\n\t"
        "vmovdqu64 %%zmm10, 640(%[o])\n\t"
        "vmovdqu64 %%zmm11, 704(%[o])\n\t"
        "vmovdqu64 %%zmm12, 768(%[o])\n\t"
        "vmovdqu64 %%zmm13, 832(%[o])\n\t"
        "vmovdqu64 %%zmm14, 896(%[o])\n\t"
        "vmovdqu64 %%zmm15, 960(%[o])"
        : [k] "+r"(k), [q] "+r"(q), [n] "+r"(n)
        : [ks] "r"(k_step), [D] "r"(D), [D3] "r"(D3), [c] "r"(corr), [o] "r"(&out[0][0][0])
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
          "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "memory",
          "cc");
}
/* attention_block's step for qvl_attention_q8 (no mask but the padding past S): query rows
 * t..t+ATQ against keys kb..kb+ABK in integer codes. Scores as byte_scores; then per row the
 * block's top score `top` (log2 units), P codes round(255 x 2^(score - top)) with the step
 * 2^(top - running max) / 255, and the value products of P and V codes (V: a step per channel
 * and block of ABK keys) scaled into the row's float sums; its P total (codes x step) into l. */
static inline __attribute__((always_inline)) void byte_tile(const uint8_t* qc, const float* qf, const ByteScores* bs,
                                                            int64_t S, int64_t S_pad, int t, int64_t kb, float* o,
                                                            float* mx, float* l, const int D) {
    const int DV = (D + 15) / 16 * 16, NV = DV / 16;
    int32_t ac[ATQ][NKB][16] __attribute__((aligned(64)));
    uint8_t pc[ATQ][ABK] __attribute__((aligned(64)));
    float step[ATQ], corr[ATQ];
    byte_scores(ac, bs->corr + kb, (const char*)(bs->kq + kb), S_pad * 4, (const char*)(qc + t * D), D, D / 4);
    const __m512 low = _mm512_set1_ps(-1e30f);
    __m512 sc[ATQ][NKB];
    float top[16] __attribute__((aligned(64))) = {0}; /* each row's top score in this block (log2 units) */
    for (int i = 0; i < ATQ; i++) {
        const __m512 rs = _mm512_set1_ps(qf[t + i] * bs->step[kb / ABK]);
        __m512 m = low;
        for (int b = 0; b < NKB; b++) {
            sc[i][b] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ac[i][b])), rs);
            const int64_t left = S - kb - 16 * b; /* keys past S: -1e30, P code 0 */
            if (left < 16) sc[i][b] = _mm512_mask_mov_ps(low, left <= 0 ? 0 : (__mmask16)((1u << left) - 1), sc[i][b]);
            m = _mm512_max_ps(m, sc[i][b]);
        }
        top[i] = _mm512_reduce_max_ps(m);
        const float prev = mx[t + i];
        corr[i] = 1.f;
        if (top[i] > prev + MAX_SLACK) { /* the running max moves (as attention_tile's) */
            corr[i] = exp2f(prev - top[i]);
            mx[t + i] = top[i];
            _mm512_store_ps(l + (t + i) * 16, _mm512_mul_ps(_mm512_load_ps(l + (t + i) * 16), _mm512_set1_ps(corr[i])));
        }
    }
    /* the rows' P steps 2^(top - running max) / 255 in one vector exp2 (four exp2f calls cost ~10% of a tile) */
    float steps[16] __attribute__((aligned(64)));
    _mm512_store_ps(steps, _mm512_mul_ps(exp2_ps(_mm512_sub_ps(_mm512_load_ps(top),
                                                               _mm512_maskz_loadu_ps((1u << ATQ) - 1, mx + t))),
                                         _mm512_set1_ps(1.f / 255.f)));
    for (int i = 0; i < ATQ; i++) {
        step[i] = steps[i];
        const __m512 nt = _mm512_set1_ps(-top[i]), full = _mm512_set1_ps(255.f);
        __m512i total = _mm512_setzero_si512();
        for (int b = 0; b < NKB; b++) {
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(exp2_ps3(_mm512_add_ps(sc[i][b], nt)), full));
            total = _mm512_add_epi32(total, c);
            _mm_store_si128((__m128i*)(pc[i] + 16 * b), _mm512_cvtepi32_epi8(c));
        }
        _mm512_store_ps(l + (t + i) * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(step[i]),
                                                           _mm512_load_ps(l + (t + i) * 16)));
    }
    int32_t pv[ATQ * 5][16] __attribute__((aligned(64)));
    const uint32_t* vq = bs->vq + (kb / 4) * DV;
    if (NV == 4) /* P codes (4 rows ABK bytes apart, a word per 4 keys) x V codes (a row of DV words per 4 keys) */
        bytes_4x4((const uint32_t*)pc, ABK, vq, DV * 4, ABK / 4, &pv[0][0]);
    else
        bytes_4x5((const uint32_t*)pc, ABK, vq, DV * 4, ABK / 4, (__mmask16)0xFFFF, &pv[0][0]);
    const float* vstep = bs->vstep + (kb / ABK) * DV;
    for (int i = 0; i < ATQ; i++)
        for (int c = 0; c < NV; c++) {
            float* oc = o + (t + i) * DV + 16 * c;
            __m512 prev = _mm512_loadu_ps(oc);
            if (corr[i] != 1.f) prev = _mm512_mul_ps(prev, _mm512_set1_ps(corr[i]));
            const __m512 w = _mm512_mul_ps(_mm512_set1_ps(step[i]), _mm512_loadu_ps(vstep + 16 * c));
            _mm512_storeu_ps(oc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(pv[i * NV + c])), w, prev));
        }
}
#endif

/* One step of attention_block: query rows t..t+ATQ against keys kb..kb+ABK. `masked` (a
 * constant after inlining) = some of those keys are hidden from some rows (causal diagonal,
 * padding past S); most steps have none and skip the masking. */
static inline __attribute__((always_inline)) void attention_tile(
    const uint16_t* qb, const uint32_t* kp, const uint32_t* vp, int64_t S, int64_t S_pad, int64_t causal,
    __m512 scale, int t, int64_t kb, float* o, float* mx, float* l, uint16_t* pb, const int D, const int masked) {
    const int DV = (D + 15) / 16 * 16; /* value pairs and sums per row: D, zero-padded to 16 lanes */
    const int GR = DV <= 80 ? 4 : 2;    /* rows per value-product group: GR x DV/16 accumulators */
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
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80); /* 1.0 in bf16 */
    for (int i = 0; i < ATQ; i++) {
        const __m512 low = _mm512_set1_ps(-1e30f);
        __m512 top = low;
        for (int b = 0; b < NKB; b++) { /* the raw scores' max (scale > 0), hidden keys at -1e30 */
            if (masked) sc[i][b] = _mm512_mask_mov_ps(low, mask[i][b], sc[i][b]);
            top = _mm512_max_ps(top, sc[i][b]);
        }
        top = _mm512_mul_ps(top, scale);
        /* the running max (of scaled scores, log2 units) moves only when a score passes it by
         * more than MAX_SLACK (so the exponentials stay below 2^MAX_SLACK): most tiles skip the
         * reduction and rescale */
        float prev = mx[t + i];
        corr[i] = 1.f;
        if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(prev + MAX_SLACK), _CMP_GT_OQ)) {
            float now = _mm512_reduce_max_ps(top);
            corr[i] = exp2f(prev - now);
            mx[t + i] = now;
            _mm512_store_ps(l + (t + i) * 16, _mm512_mul_ps(_mm512_load_ps(l + (t + i) * 16), _mm512_set1_ps(corr[i])));
        }
        const __m512 nv = _mm512_set1_ps(-mx[t + i]);
        __m512 sum = _mm512_load_ps(l + (t + i) * 16);
        for (int b = 0; b < NKB; b++) { /* 2^(score * scale - max), to be rounded to bf16 */
            sc[i][b] = exp2_ps3(_mm512_fmadd_ps(sc[i][b], scale, nv));
            if (masked) sc[i][b] = _mm512_maskz_mov_ps(mask[i][b], sc[i][b]);
        }
        for (int b = 0; b < NKB; b += 2) {
            const __m512bh pair = _mm512_cvtne2ps_pbh(sc[i][b + 1], sc[i][b]);
            _mm512_storeu_si512(pb + i * ABK + 16 * b, (__m512i)pair);
            sum = _mm512_dpbf16_ps(sum, pair, ones); /* summed as rounded, as the value product weighs them */
        }
        _mm512_store_ps(l + (t + i) * 16, sum);
    }
    for (int g = 0; g < ATQ; g += GR) {
        __m512 acc[4][8];
        for (int i = 0; i < GR; i++)
            for (int d = 0; d < DV / 16; d++) {
                __m512 prev = _mm512_loadu_ps(o + (t + g + i) * DV + 16 * d);
                acc[i][d] = corr[g + i] == 1.f ? prev : _mm512_mul_ps(prev, _mm512_set1_ps(corr[g + i]));
            }
        for (int jp = 0; jp < ABK / 2; jp++) {
            const uint32_t* vrow = vp + (kb / 2 + jp) * DV;
            for (int i = 0; i < GR; i++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32((int)((const uint32_t*)(pb + (g + i) * ABK))[jp]);
                for (int d = 0; d < DV / 16; d++)
                    acc[i][d] = _mm512_dpbf16_ps(acc[i][d], a, (__m512bh)_mm512_loadu_si512(vrow + 16 * d));
            }
        }
        for (int i = 0; i < GR; i++)
            for (int d = 0; d < DV / 16; d++) _mm512_storeu_ps(o + (t + g + i) * DV + 16 * d, acc[i][d]);
    }
}

/* Flash attention for the query rows [0, rows) of one head: scores and products in
 * AVX512-BF16 dot products with float32 accumulation, online softmax in float32.
 * kp: [D/2][S_pad] key pairs (k[n][2p], k[n][2p+1]); vp: [S_pad/2][DV] value pairs
 * (v[2j][d], v[2j+1][d]), DV = D rounded up to 16 (zero past D); keys >= S are zero and
 * masked. causal >= 0: row r sees keys j <= causal + r only (causal = the first row's
 * position); -1: every row sees all keys. */
static inline __attribute__((always_inline)) void attention_block(
    const uint16_t* q, int64_t q_stride, int64_t rows, const uint32_t* kp, const uint32_t* vp, int64_t S,
    int64_t S_pad, int64_t causal, float scale2, uint16_t* out, int64_t out_stride, const ByteScores* bs,
    const int D) {
    uint16_t qb[ABQ * 128] __attribute__((aligned(64)));
    uint8_t qc[ABQ * 128] __attribute__((aligned(64))); /* with bs: each row's codes + 128 */
    float qf[ABQ];                                      /* with bs: each row's step x scale2 */
    float o[ABQ * 128] __attribute__((aligned(64)));
    uint16_t pb[ATQ * ABK] __attribute__((aligned(64)));
    float mx[ABQ], l[ABQ * 16] __attribute__((aligned(64))); /* running max; running sums per lane */
    for (int r = 0; r < ABQ; r++) {
        if (r < rows)
            memcpy(qb + r * D, q + r * q_stride, (size_t)D * 2);
        else
            memset(qb + r * D, 0, (size_t)D * 2);
        mx[r] = -1e30f;
#ifdef QVL_BYTE_SCORES
        if (bs) { /* one step per row: max |q| / 127 (the caller checked that q is finite) */
            __m512 xs[8], amax = _mm512_setzero_ps();
            for (int c = 0; c < (D + 15) / 16; c++) {
                xs[c] = load16_bf16(qb + r * D + 16 * c, D - 16 * c);
                amax = _mm512_max_ps(amax, _mm512_abs_ps(xs[c]));
            }
            const float top = _mm512_reduce_max_ps(amax), step = top > 0.f ? top / 127.f : 1.f;
            const __m512 inv = _mm512_set1_ps(1.f / step);
            for (int c = 0; c < (D + 15) / 16; c++) {
                const __m128i b = _mm512_cvtepi32_epi8(_mm512_add_epi32(codes16(xs[c], inv), _mm512_set1_epi32(128)));
                _mm_mask_storeu_epi8(qc + r * D + 16 * c, D - 16 * c >= 16 ? (__mmask16)0xFFFF
                                                                          : (__mmask16)((1u << (D - 16 * c)) - 1), b);
            }
            qf[r] = step * scale2;
        }
#endif
    }
    const int DV = (D + 15) / 16 * 16;
    memset(o, 0, sizeof(float) * ABQ * DV);
    memset(l, 0, sizeof(l));
    const __m512 scale = _mm512_set1_ps(scale2);
    const int64_t key_end = causal < 0 ? S_pad : (causal + rows < S ? causal + rows : S); /* keys any row sees */
    for (int64_t kb = 0; kb < key_end; kb += ABK) {
        for (int t = 0; t < ABQ && t < rows; t += ATQ) {
            int64_t first_seen = causal < 0 ? S : (causal + t + 1 < S ? causal + t + 1 : S);
#ifdef QVL_BYTE_SCORES
            if (bs) {
                if (D == 64 || D == 72 || D == 80) byte_tile(qc, qf, bs, S, S_pad, t, kb, o, mx, l, D);
                continue;
            }
#endif
            if (kb + ABK <= first_seen)
                attention_tile(qb, kp, vp, S, S_pad, causal, scale, t, kb, o, mx, l, pb, D, 0);
            else
                attention_tile(qb, kp, vp, S, S_pad, causal, scale, t, kb, o, mx, l, pb, D, 1);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float inv = 1.f / _mm512_reduce_add_ps(_mm512_load_ps(l + r * 16));
        for (int d = 0; d < D; d++) out[r * out_stride + d] = f32_to_bf16(o[r * DV + d] * inv);
    }
}

/* attention_block for a head size known at run time (D 32, 64, 72, 80 or 128). */
static void head_block(const uint16_t* q, int64_t q_stride, int64_t rows, const uint32_t* kp, const uint32_t* vp,
                       int64_t S, int64_t S_pad, int64_t causal, float scale2, uint16_t* out, int64_t out_stride,
                       const ByteScores* bs, int64_t D) {
    if (D == 32) /* the tiny test checkpoints' heads: the tests run the default path's kernel */
        attention_block(q, q_stride, rows, kp, vp, S, S_pad, causal, scale2, out, out_stride, bs, 32);
    else if (D == 72)
        attention_block(q, q_stride, rows, kp, vp, S, S_pad, causal, scale2, out, out_stride, bs, 72);
    else if (D == 80)
        attention_block(q, q_stride, rows, kp, vp, S, S_pad, causal, scale2, out, out_stride, bs, 80);
    else if (D == 64)
        attention_block(q, q_stride, rows, kp, vp, S, S_pad, causal, scale2, out, out_stride, bs, 64);
    else
        attention_block(q, q_stride, rows, kp, vp, S, S_pad, causal, scale2, out, out_stride, bs, 128);
}

/* out = softmax(q k^T / sqrt(D)) v for T queries over S keys, grouped-query (query head h
 * uses key/value head h / (H / Hkv)). Every tensor is bf16 with D contiguous and strides
 * in elements: q[t][h] at t*q_tok + h*q_head, likewise k, v (positions j), out. With a block
 * table (a paged KV cache; NULL: positions as strided above), position j of k or v is at
 * kv_blocks[j/block]*block_stride + (j%block)*k_tok (v_tok) + h*k_head (v_head); block % 16 == 0.
 * causal >= 0: query t sees keys j <= causal + t (prefill of positions causal..causal+T-1
 * over a cache of S = causal + T); -1: no mask (vision). D = 32, 64 or 128, and 72 or 80 for
 * vision; where the process has AMX tiles, attention runs only on them (qvl_amx_attention, even D <= 128; -2 otherwise,
 * and the caller takes torch's SDPA), except causal calls over fewer keys than causal + T (query t then sees keys up
 * to min(causal + t, S - 1)), which these dot products take.
 * Returns 0, -1 when out of memory, -2 when D or the heads are not supported. */
int qvl_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t T, int64_t S,
                  int64_t H, int64_t Hkv, int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                  int64_t v_tok, int64_t v_head, int64_t o_tok, int64_t o_head, int64_t causal, const int64_t* kv_blocks,
                  int64_t block, int64_t block_stride, int threads) {
    if (qvl_int8_amx_ready() && (causal < 0 || causal + T <= S)) /* tiles: several times these dot products */
        return qvl_amx_attention(q, k, v, out, T, S, H, Hkv, D, q_tok, q_head, k_tok, k_head, v_tok, v_head, o_tok,
                                 o_head, causal, kv_blocks, block, block_stride, threads);
    const int vision_only = D == 72 || D == 80; /* the 1152-wide towers' heads (8B and larger) */
    if ((D != 32 && D != 64 && D != 128 && !(vision_only && causal < 0 && !kv_blocks)) || Hkv < 1 || H % Hkv != 0 ||
        (kv_blocks && (block < 16 || block % 16)))
        return -2;
    /* key pairs per key: D/2 rounded up to 16 (pack_keys' transposes); value lanes: D rounded up to 16 */
    const int64_t S_pad = (S + ABK - 1) / ABK * ABK, G = H / Hkv, DP = (D / 2 + 15) / 16 * 32, DV = (D + 15) / 16 * 16;
    uint32_t* kp = aligned_alloc(64, (size_t)(Hkv * S_pad * DP * 2));
    uint32_t* vp = aligned_alloc(64, (size_t)(Hkv * S_pad * DV * 2));
    if (!kp || !vp) {
        free(kp), free(vp);
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < Hkv; h++) {
        pack_head(k + h * k_head, k_tok, v + h * v_head, v_tok, S, S_pad, D, DP, DV, kv_blocks, block, block_stride,
                  kp + h * (DP / 2) * S_pad, 1, S_pad, vp + h * (S_pad / 2) * DV);
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
        const uint32_t* kh = kp + (h / G) * (DP / 2) * S_pad;
        const uint32_t* vh = vp + (h / G) * (S_pad / 2) * DV;
        head_block(qh, q_tok, rows, kh, vh, S, S_pad, causal < 0 ? -1 : causal + r0, scale2, oh, o_tok, NULL, D);
    }
    free(kp), free(vp);
    return 0;
}

#ifdef QVL_BYTE_SCORES
static inline int all_finite_bf16(const uint16_t* x, int64_t n) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= (x[i] & 0x7F80) == 0x7F80; /* exponent all ones: inf or NaN */
    return !bad;
}

/* One head's keys as ByteScores (kq [D/4][S_pad], corr [S_pad], step [S_pad/ABK]) from k [S][D]
 * bf16 (rows k_tok apart), D % 4 == 0, D <= 128. 16 keys at a time: each key's codes as 16-byte
 * rows of words (groups of 4 dimensions), transposed in registers to a row per group. Returns
 * 0, or -2 when a key holds a NaN or an infinity. */
static int pack_key_codes(const uint16_t* k, int64_t k_tok, int64_t S, int64_t S_pad, int64_t D, uint32_t* kq,
                          int32_t* corr, float* step) {
    const int64_t V = (D + 15) / 16; /* float vectors per key */
    __m512 mean[8], x[ABK][8];
    for (int64_t c = 0; c < V; c++) mean[c] = _mm512_setzero_ps();
    for (int64_t n = 0; n < S; n++)
        for (int64_t c = 0; c < V; c++) mean[c] = _mm512_add_ps(mean[c], load16_bf16(k + n * k_tok + 16 * c, D - 16 * c));
    const __m512 count = _mm512_set1_ps((float)S);
    for (int64_t c = 0; c < V; c++) { /* a NaN or infinity in any key makes its lane of the sum one too */
        mean[c] = _mm512_div_ps(mean[c], count);
        if (_mm512_cmp_ps_mask(_mm512_abs_ps(mean[c]), _mm512_set1_ps(INFINITY), _CMP_NLT_UQ)) return -2;
    }
    for (int64_t n0 = 0; n0 < S_pad; n0 += ABK) {
        __m512 amax = _mm512_setzero_ps();
        for (int64_t j = 0; j < ABK; j++)
            for (int64_t c = 0; c < V; c++) {
                x[j][c] = n0 + j < S ? _mm512_sub_ps(load16_bf16(k + (n0 + j) * k_tok + 16 * c, D - 16 * c), mean[c])
                                     : _mm512_setzero_ps(); /* lanes past D: zero (so is the mean there) */
                amax = _mm512_max_ps(amax, _mm512_abs_ps(x[j][c]));
            }
        const float top = _mm512_reduce_max_ps(amax);
        if (!isfinite(top)) return -2; /* finite keys near bf16's limit whose distance to the mean overflows */
        const float st = top > 0.f ? top / 127.f : 1.f;
        const __m512 inv = _mm512_set1_ps(1.f / st);
        step[n0 / ABK] = st;
        for (int64_t j0 = 0; j0 < ABK; j0 += 16) {
            __m512 r[2][16]; /* per key: its D codes as bytes, groups 0..15 and 16..31 as words */
            for (int64_t j = 0; j < 16; j++) {
                __m512i sum = _mm512_setzero_si512();
                __m128i b[8];
                for (int64_t c = 0; c < V; c++) {
                    const __m512i q = codes16(x[j0 + j][c], inv);
                    sum = _mm512_add_epi32(sum, q);
                    b[c] = _mm512_cvtepi32_epi8(q);
                }
                for (int64_t c = V; c < 8; c++) b[c] = _mm_setzero_si128();
                corr[n0 + j0 + j] = -128 * _mm512_reduce_add_epi32(sum);
                r[0][j] = _mm512_castsi512_ps(_mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_set_m128i(b[1], b[0])), _mm256_set_m128i(b[3], b[2]), 1));
                r[1][j] = _mm512_castsi512_ps(_mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_set_m128i(b[5], b[4])), _mm256_set_m128i(b[7], b[6]), 1));
            }
            for (int h = 0; h < 2 && 16 * h < D / 4; h++) {
                transpose16(r[h]);
                for (int64_t g = 16 * h; g < D / 4 && g < 16 * h + 16; g++)
                    _mm512_storeu_ps((float*)(kq + g * S_pad + n0 + j0), r[h][g - 16 * h]);
            }
        }
    }
    return 0;
}

/* One head's values as ByteScores' vq [S_pad/4][DV] and vstep [S_pad/ABK][DV] from v [S][D] bf16
 * (rows v_tok apart): per block of ABK keys and channel, max |v| / 127. Returns 0, or -2 when a
 * value is a NaN or an infinity. */
static int pack_value_codes(const uint16_t* v, int64_t v_tok, int64_t S, int64_t S_pad, int64_t D, uint32_t* vq,
                            float* vstep) {
    const int64_t NV = (D + 15) / 16, DV = 16 * NV;
    const __m512 inf = _mm512_set1_ps(INFINITY);
    const __m512i byte = _mm512_set1_epi32(0xFF);
    for (int64_t n0 = 0; n0 < S_pad; n0 += ABK)
        for (int64_t c = 0; c < NV; c++) {
            __m512 x[ABK], amax = _mm512_setzero_ps();
            __mmask16 bad = 0;
            for (int64_t j = 0; j < ABK; j++) {
                x[j] = n0 + j < S ? load16_bf16(v + (n0 + j) * v_tok + 16 * c, D - 16 * c) : _mm512_setzero_ps();
                bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(x[j]), inf, _CMP_NLT_UQ);
                amax = _mm512_max_ps(amax, _mm512_abs_ps(x[j]));
            }
            if (bad) return -2;
            const __m512 st = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                   _mm512_set1_ps(1.f), _mm512_div_ps(amax, _mm512_set1_ps(127.f)));
            const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), st);
            _mm512_storeu_ps(vstep + (n0 / ABK) * DV + 16 * c, st);
            for (int64_t j = 0; j < ABK; j += 4) { /* channel d of keys j..j+3 in one word */
                __m512i w = _mm512_setzero_si512();
                for (int e = 0; e < 4; e++)
                    w = _mm512_or_si512(w, _mm512_slli_epi32(_mm512_and_si512(codes16(x[j + e], inv), byte), 8 * e));
                _mm512_storeu_si512(vq + ((n0 + j) / 4) * DV + 16 * c, w);
            }
        }
    return 0;
}

/* qvl_attention for the vision tower (no mask, H == Hkv, D 64, 72 or 80) in 8-bit integer codes
 * on VNNI's byte products: the scores as SageAttention does (keys centred over the image, a step
 * per block of ABK keys; queries a step per row), P in unsigned codes per row and key block
 * (255 x 2^(score - the block's top)) and V in signed codes per channel and key block: every
 * product in vpdpbusd, half the instructions of bf16 pairs (byte_tile). Returns 0, -1 when out
 * of memory, -2 when the shapes do not apply or q, k or v holds a NaN or an infinity (the caller
 * takes the bf16 kernel). */
int qvl_attention_q8(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t T, int64_t S,
                     int64_t H, int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head, int64_t v_tok,
                     int64_t v_head, int64_t o_tok, int64_t o_head, int threads) {
    if ((D != 64 && D != 72 && D != 80) || S < 1)
        return -2;
    for (int64_t t = 0; t < T; t++) /* q finite: its codes' steps need it (a pass over q, ~1% of the kernel) */
        for (int64_t h = 0; h < H; h++)
            if (!all_finite_bf16(q + t * q_tok + h * q_head, D)) return -2;
    const int64_t S_pad = (S + ABK - 1) / ABK * ABK, DV = (D + 15) / 16 * 16;
    uint32_t* kq = aligned_alloc(64, (size_t)(H * S_pad * D));
    int32_t* corr = aligned_alloc(64, (size_t)(H * S_pad) * sizeof(int32_t));
    float* steps = malloc((size_t)(H * (S_pad / ABK)) * sizeof(float));
    uint32_t* vq = aligned_alloc(64, (size_t)(H * S_pad * DV));
    float* vsteps = aligned_alloc(64, (size_t)(H * (S_pad / ABK) * DV) * sizeof(float));
    int status = !kq || !corr || !steps || !vq || !vsteps ? -1 : 0;
    if (!status) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t h = 0; h < H; h++) {
            if (pack_key_codes(k + h * k_head, k_tok, S, S_pad, D, kq + h * (D / 4) * S_pad, corr + h * S_pad,
                               steps + h * (S_pad / ABK)) != 0 ||
                pack_value_codes(v + h * v_head, v_tok, S, S_pad, D, vq + h * (S_pad / 4) * DV,
                                 vsteps + h * (S_pad / ABK) * DV) != 0) {
#pragma omp atomic write
                status = -2;
            }
        }
    }
    if (status) {
        free(kq), free(corr), free(steps), free(vq), free(vsteps);
        return status;
    }
    const int64_t blocks = (T + ABQ - 1) / ABQ;
    const float scale2 = 1.4426950408889634f / sqrtf((float)D); /* softmax in base 2 */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < H * blocks; item++) {
        const int64_t h = item / blocks, r0 = (item % blocks) * ABQ, rows = T - r0 < ABQ ? T - r0 : ABQ;
        const ByteScores bs = {kq + h * (D / 4) * S_pad, corr + h * S_pad, steps + h * (S_pad / ABK),
                               vq + h * (S_pad / 4) * DV, vsteps + h * (S_pad / ABK) * DV};
        head_block(q + r0 * q_tok + h * q_head, q_tok, rows, NULL, NULL, S, S_pad, -1, scale2,
                   out + r0 * o_tok + h * o_head, o_tok, &bs, D);
    }
    free(kq), free(corr), free(steps), free(vq), free(vsteps);
    return 0;
}
#endif

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
#pragma omp parallel for num_threads(threads) schedule(static)
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
#else
int qvl_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t T, int64_t S,
                  int64_t H, int64_t Hkv, int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                  int64_t v_tok, int64_t v_head, int64_t o_tok, int64_t o_head, int64_t causal, const int64_t* kv_blocks,
                  int64_t block, int64_t block_stride, int threads) {
    (void)q, (void)k, (void)v, (void)out, (void)T, (void)S, (void)H, (void)Hkv, (void)D, (void)q_tok, (void)q_head,
        (void)k_tok, (void)k_head, (void)v_tok, (void)v_head, (void)o_tok, (void)o_head, (void)causal, (void)kv_blocks,
        (void)block, (void)block_stride, (void)threads;
    return -2;
}

int qvl_vision_rope(const uint16_t* x, int64_t tok, int64_t head, int64_t N, int64_t H, int64_t D, const float* cos,
                    const float* sin, uint16_t* out, int threads) {
    (void)x, (void)tok, (void)head, (void)N, (void)H, (void)D, (void)cos, (void)sin, (void)out, (void)threads;
    return -2;
}
#endif
#ifndef QVL_BYTE_SCORES
int qvl_attention_q8(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t T, int64_t S,
                     int64_t H, int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head, int64_t v_tok,
                     int64_t v_head, int64_t o_tok, int64_t o_head, int threads) {
    (void)q, (void)k, (void)v, (void)out, (void)T, (void)S, (void)H, (void)D, (void)q_tok, (void)q_head, (void)k_tok,
        (void)k_head, (void)v_tok, (void)v_head, (void)o_tok, (void)o_head, (void)threads;
    return -2;
}
#endif

#if defined(QVL_AVX2) || defined(QVL_AVX512) /* the AVX-512 tier has AVX2 too */
/* The vision tower's attention in 16-bit integer pairs (vpmaddwd: 16 multiply-adds per ymm
 * instruction, twice float32's FMA; the AVX-512 build: zmm, and vpdpwssd with AVX512-VNNI, 32)
 * for CPUs without bf16 dot products, where the tower's linears already run int8 x int8. q in
 * codes per row, k per block of IBK keys (|c| <= QK_CODE), v per channel (|c| <= V_CODE). Per query row and key block, the probabilities 2^(s - the
 * block's top score) in codes 0..P_CODE; their products with v are summed exactly in int32 and
 * added to float sums weighed by 2^(block top - running top). The bounds keep every int32 sum
 * exact: 128 pairs of q and k codes, IBK of P and v codes, stay below 2^31. */
#define IBK 64  /* keys per block */
#define ITQ 4   /* query rows per tile: ITQ x 2 accumulators in both products */
#define IBQ 32  /* query rows per block: their float sums and a key block stay in L1 */
#define QK_CODE 4095.f
#define P_LOG2 13 /* P codes 0..2^13 */
#define V_CODE 4095.f

static inline uint32_t code_pair(float a, float b, float inv) {
    return (uint32_t)(uint16_t)(int16_t)round_int(a * inv) | (uint32_t)(uint16_t)(int16_t)round_int(b * inv) << 16;
}

/* x (D floats) rotated as the vision tower's RoPE does (x cos + rotate_half(x) sin, cos and sin
 * [D] of its position) into out; x itself when cos is NULL. FMAs round differently from the
 * reference's products and sum, by about an ulp, far below a code step. */
static inline const float* rotated(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
    if (!cos) return x;
    const int64_t h = D / 2;
    for (int64_t d = 0; d < h; d++) out[d] = x[d] * cos[d] - x[d + h] * sin[d];
    for (int64_t d = h; d < D; d++) out[d] = x[d] * cos[d] + x[d - h] * sin[d];
    return out;
}

/* One head's keys as code pairs kp [D/2][S_pad] with a scale per block of IBK keys ks, and its
 * values as code pairs vp [S_pad/2][D] (v[2j][d], v[2j+1][d]) with a scale per channel vs;
 * zero past S. cos, sin (or NULL): the keys' RoPE tables, rows cs_tok apart (k is rotated here).
 * Returns 0, or 1 when k or v holds a NaN or an infinity. */
static int pack_i16(const float* k, int64_t k_tok, const float* v, int64_t v_tok, const float* cos, const float* sin,
                    int64_t cs_tok, int64_t S, int64_t S_pad, int64_t D, uint32_t* kp, float* ks, uint32_t* vp,
                    float* vs) {
    float rows[IBK][128];
    for (int64_t kb = 0; kb < S_pad; kb += IBK) {
        const int64_t n = S - kb < IBK ? S - kb : IBK;
        float m = 0.f;
        for (int64_t j = kb; j < kb + n; j++) {
            const float* kr = rotated(k + j * k_tok, cos ? cos + j * cs_tok : NULL, sin ? sin + j * cs_tok : NULL, D,
                                      rows[j - kb]);
            if (!all_finite(kr, D)) return 1;
            if (kr != rows[j - kb]) memcpy(rows[j - kb], kr, (size_t)D * sizeof(float));
            const float a = absmax(rows[j - kb], D);
            m = a > m ? a : m;
        }
        const float inv = m > 0.f ? QK_CODE / m : 0.f;
        ks[kb / IBK] = m / QK_CODE;
        for (int64_t j = kb; j < kb + IBK; j++)
            for (int64_t p = 0; p < D / 2; p++)
                kp[p * S_pad + j] = j < S ? code_pair(rows[j - kb][2 * p], rows[j - kb][2 * p + 1], inv) : 0;
    }
    float inv[128];
    for (int64_t d = 0; d < D; d++) vs[d] = 0.f;
    for (int64_t j = 0; j < S; j++) {
        if (!all_finite(v + j * v_tok, D)) return 1;
        for (int64_t d = 0; d < D; d++) {
            const float a = fabsf(v[j * v_tok + d]);
            vs[d] = a > vs[d] ? a : vs[d];
        }
    }
    for (int64_t d = 0; d < D; d++) {
        inv[d] = vs[d] > 0.f ? V_CODE / vs[d] : 0.f;
        vs[d] /= V_CODE;
    }
    for (int64_t j = 0; j < S_pad; j += 2)
        for (int64_t d = 0; d < D; d++) {
            const float a = j < S ? v[j * v_tok + d] : 0.f, b = j + 1 < S ? v[(j + 1) * v_tok + d] : 0.f;
            vp[(j / 2) * D + d] = code_pair(a, b, inv[d]);
        }
    return 0;
}

static inline int32_t hmax256_epi32(__m256i v) {
    __m128i s = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_max_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_max_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

static inline int32_t hsum256_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* P codes round(2^x) for x <= P_LOG2 (degree-4 polynomial, relative error ~4e-6, far below a
 * code step); x below -100 gives 0. */
static inline __m256i p_codes(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-100.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(9.6181291e-3f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022652e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
    return _mm256_min_epi32(_mm256_cvtps_epi32(p), _mm256_set1_epi32(1 << P_LOG2));
}

#if defined(QVL_AVX512)
static inline __m512i p_codes512(__m512 x) { /* p_codes on 16 lanes, the same operations */
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.6181291e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
    return _mm512_min_epi32(_mm512_cvtps_epi32(p), _mm512_set1_epi32(1 << P_LOG2));
}
#endif

/* acc[i][0..1] (8 int32 each) += sum over p < n of the 16-bit pair a[i][p] (rows a_row bytes
 * apart) times the 16 pairs at b + p * b_step bytes, for 4 rows i: vpmaddwd and vpaddd in
 * assembly, because GCC copies every accumulator once per step here (8 register moves per 8
 * products, 1.25x slower). Both products run on it: q codes x key pairs, P codes x
 * value pairs. */
#if !defined(QVL_AVX512)
static inline void pair_products(const uint32_t* a, int64_t a_row, const uint32_t* b, int64_t b_step, int64_t n,
                                 __m256i acc[4][2]) {
    const char* a2 = (const char*)a + 2 * a_row;
    __asm__("1:\n\t"
            "vmovdqu (%[b]), %%ymm12\n\t"
            "vmovdqu 32(%[b]), %%ymm13\n\t"
            "vpbroadcastd (%[a]), %%ymm14\n\t"
            "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"
            "vpaddd %%ymm15, %[c0], %[c0]\n\t"
            "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"
            "vpaddd %%ymm15, %[c1], %[c1]\n\t"
            "vpbroadcastd (%[a], %[ar]), %%ymm14\n\t"
            "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"
            "vpaddd %%ymm15, %[c2], %[c2]\n\t"
            "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"
            "vpaddd %%ymm15, %[c3], %[c3]\n\t"
            "vpbroadcastd (%[a2]), %%ymm14\n\t"
            "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"
            "vpaddd %%ymm15, %[c4], %[c4]\n\t"
            "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"
            "vpaddd %%ymm15, %[c5], %[c5]\n\t"
            "vpbroadcastd (%[a2], %[ar]), %%ymm14\n\t"
            "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"
            "vpaddd %%ymm15, %[c6], %[c6]\n\t"
            "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"
            "vpaddd %%ymm15, %[c7], %[c7]\n\t"
            "add $4, %[a]\n\t"
            "add $4, %[a2]\n\t"
            "add %[bs], %[b]\n\t"
            "dec %[n]\n\t"
            "jnz 1b"
            : [c0] "+x"(acc[0][0]), [c1] "+x"(acc[0][1]), [c2] "+x"(acc[1][0]), [c3] "+x"(acc[1][1]),
              [c4] "+x"(acc[2][0]), [c5] "+x"(acc[2][1]), [c6] "+x"(acc[3][0]), [c7] "+x"(acc[3][1]), [a] "+r"(a),
              [a2] "+r"(a2), [b] "+r"(b), [n] "+r"(n)
            : [ar] "r"(a_row), [bs] "r"(b_step)
            : "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
}
#endif

#if defined(QVL_AVX512)
/* The AVX-512 build's two products: zmm registers, and with AVX512-VNNI one vpdpwssd per 32
 * multiply-adds (twice the AVX2 loop's rate per instruction). The same exact int32 sums, so the
 * same bits as the AVX2 build. */
#ifndef __AVX512VNNI__ /* the C loops below: AVX-512 without VNNI (with it: products_4x4 and 4x5, above) */
#define MADD512(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

/* sc[i][0..IBK) = the ITQ rows' code pairs qc (rows np pairs apart) times keys kb.. of kp
 * ([np][S_pad] pairs): 4 x 4 accumulators. */
static inline __attribute__((always_inline)) void score_products512(const uint32_t* qc, const uint32_t* kp,
                                                                    int64_t S_pad, const int np,
                                                                    int32_t sc[ITQ][IBK]) {
#ifdef __AVX512VNNI__
    products_4x4(qc, (int64_t)np * 4, kp, S_pad * 4, np, sc[0]);
#else
    __m512i acc[ITQ][IBK / 16];
    for (int i = 0; i < ITQ; i++)
        for (int b = 0; b < IBK / 16; b++) acc[i][b] = _mm512_setzero_si512();
    for (int p = 0; p < np; p++) {
        __m512i kv[IBK / 16];
        for (int b = 0; b < IBK / 16; b++) kv[b] = _mm512_loadu_si512(kp + p * S_pad + 16 * b);
        for (int i = 0; i < ITQ; i++) {
            const __m512i a = _mm512_set1_epi32((int)qc[i * np + p]);
            for (int b = 0; b < IBK / 16; b++) acc[i][b] = MADD512(acc[i][b], a, kv[b]);
        }
    }
    for (int i = 0; i < ITQ; i++)
        for (int b = 0; b < IBK / 16; b++) _mm512_store_si512(sc[i] + 16 * b, acc[i][b]);
#endif
}

/* o[t+i][0..D) += w[i] * (the ITQ rows' P code pairs pc times the value pairs vp ([IBK/2][D]
 * from the block's first)): 4 x ceil(D/16) accumulators, the last vector masked when D % 16. */
static inline __attribute__((always_inline)) void value_products512(const uint32_t pc[ITQ][IBK / 2],
                                                                    const uint32_t* vp, const float* w, float* o,
                                                                    const int D) {
    enum { NV = 5 };
    const int nv = (D + 15) / 16;
    const __mmask16 last = D % 16 ? (__mmask16)((1u << (D % 16)) - 1) : (__mmask16)0xFFFF;
    int32_t sums[ITQ * NV * 16] __attribute__((aligned(64))); /* [ITQ][nv][16] */
#ifdef __AVX512VNNI__
    if (nv == 4)
        products_4x4(pc[0], IBK / 2 * 4, vp, (int64_t)D * 4, IBK / 2, sums);
    else
        products_4x5(pc[0], IBK / 2 * 4, vp, (int64_t)D * 4, IBK / 2, last, sums);
#else
    __m512i acc[ITQ][NV];
    for (int i = 0; i < ITQ; i++)
        for (int d = 0; d < NV; d++) acc[i][d] = _mm512_setzero_si512();
    for (int jp = 0; jp < IBK / 2; jp++) {
        __m512i v[NV];
        for (int d = 0; d < nv; d++)
            v[d] = _mm512_maskz_loadu_epi32(d == nv - 1 ? last : (__mmask16)0xFFFF, vp + jp * D + 16 * d);
        for (int i = 0; i < ITQ; i++) {
            const __m512i a = _mm512_set1_epi32((int)pc[i][jp]);
            for (int d = 0; d < nv; d++) acc[i][d] = MADD512(acc[i][d], a, v[d]);
        }
    }
    for (int i = 0; i < ITQ; i++)
        for (int d = 0; d < nv; d++) _mm512_store_si512(sums + (i * nv + d) * 16, acc[i][d]);
#endif
    for (int i = 0; i < ITQ; i++) {
        const __m512 wv = _mm512_set1_ps(w[i]);
        for (int d = 0; d < nv; d++) {
            const __mmask16 m = d == nv - 1 ? last : (__mmask16)0xFFFF;
            float* orow = o + i * D + 16 * d;
            const __m512i acc = _mm512_load_si512(sums + (i * nv + d) * 16);
            _mm512_mask_storeu_ps(orow, m, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), wv, _mm512_maskz_loadu_ps(m, orow)));
        }
    }
}
#endif

/* Query rows t..t+ITQ of a block against keys kb..kb+IBK: scores, P codes, value products into
 * the float sums o [IBQ][D], running tops mx and sums l. `masked` (constant after inlining):
 * keys from S on are padding. */
static inline __attribute__((always_inline)) void i16_tile(const uint32_t* qc, const float* qs, const uint32_t* kp,
                                                           float kscale, const uint32_t* vp, int64_t S,
                                                           int64_t S_pad, int t, int64_t kb, float* o, float* mx,
                                                           float* l, const int D, const int masked) {
    int32_t sc[ITQ][IBK] __attribute__((aligned(64)));
#if defined(QVL_AVX512)
    score_products512(qc + t * (D / 2), kp + kb, S_pad, D / 2, sc);
#else
    for (int c = 0; c < IBK; c += 16) {
        __m256i acc[ITQ][2];
        for (int i = 0; i < ITQ; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        pair_products(qc + t * (D / 2), D / 2 * 4, kp + kb + c, S_pad * 4, D / 2, acc);
        for (int i = 0; i < ITQ; i++) {
            _mm256_store_si256((__m256i*)(sc[i] + c), acc[i][0]);
            _mm256_store_si256((__m256i*)(sc[i] + c + 8), acc[i][1]);
        }
    }
#endif
    if (masked)
        for (int i = 0; i < ITQ; i++)
            for (int j = 0; j < IBK; j++)
                if (kb + j >= S) sc[i][j] = INT32_MIN / 2;
    float f[ITQ], top[8] __attribute__((aligned(32))) = {0}, w[8] __attribute__((aligned(32)));
    int32_t bt[ITQ];
    for (int i = 0; i < ITQ; i++) { /* each row's top score in the block; a new running top shrinks the sums */
        __m256i m = _mm256_load_si256((const __m256i*)sc[i]);
        for (int j = 8; j < IBK; j += 8) m = _mm256_max_epi32(m, _mm256_load_si256((const __m256i*)(sc[i] + j)));
        bt[i] = hmax256_epi32(m);
        f[i] = qs[t + i] * kscale;
        const float now = (float)bt[i] * f[i], prev = mx[t + i];
        if (now > prev) {
            const float corr = exp2f(prev - now);
            for (int d = 0; d < D; d++) o[(t + i) * D + d] *= corr;
            l[t + i] *= corr;
            mx[t + i] = now;
        }
        top[i] = now - mx[t + i];
    }
    _mm256_store_ps(w, exp2_ps256(_mm256_load_ps(top))); /* each block's weight, 2^(block top - running top) */
    uint32_t pc[ITQ][IBK / 2] __attribute__((aligned(32))); /* P code pairs */
#if defined(QVL_AVX512)
    for (int i = 0; i < ITQ; i++) { /* the same operations on 16 lanes: the same codes */
        const __m512 fv = _mm512_set1_ps(f[i]), off = _mm512_set1_ps((float)P_LOG2 - (float)bt[i] * f[i]);
        __m512i sum = _mm512_setzero_si512();
        for (int j = 0; j < IBK; j += 16) {
            __m512i c = p_codes512(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sc[i] + j)), fv, off));
            if (masked) {
                const __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int)(kb + j)),
                                                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
                c = _mm512_maskz_mov_epi32(_mm512_cmplt_epi32_mask(at, _mm512_set1_epi32((int)S)), c);
            }
            sum = _mm512_add_epi32(sum, c);
            _mm256_store_si256((__m256i*)(pc[i] + j / 2), _mm512_cvtepi32_epi16(c));
        }
        l[t + i] += w[i] * (float)_mm512_reduce_add_epi32(sum);
    }
#else
    for (int i = 0; i < ITQ; i++) {
        const __m256 fv = _mm256_set1_ps(f[i]), off = _mm256_set1_ps((float)P_LOG2 - (float)bt[i] * f[i]);
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < IBK; j += 16) {
            const __m256 s0 = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(sc[i] + j)));
            const __m256 s1 = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(sc[i] + j + 8)));
            __m256i c0 = p_codes(_mm256_fmadd_ps(s0, fv, off)), c1 = p_codes(_mm256_fmadd_ps(s1, fv, off));
            if (masked) {
                const __m256i at = _mm256_add_epi32(_mm256_set1_epi32((int)(kb + j)),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                const __m256i end = _mm256_set1_epi32((int)S);
                c0 = _mm256_and_si256(c0, _mm256_cmpgt_epi32(end, at));
                c1 = _mm256_and_si256(c1, _mm256_cmpgt_epi32(end, _mm256_add_epi32(at, _mm256_set1_epi32(8))));
            }
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(c0, c1));
            _mm256_store_si256((__m256i*)(pc[i] + j / 2), _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xD8));
        }
        l[t + i] += w[i] * (float)hsum256_epi32(sum);
    }
#endif
#if defined(QVL_AVX512)
    value_products512(pc, vp + (kb / 2) * D, w, o + t * D, D);
#else
    for (int d = 0; d < D; d += 16) {
        const int two = d + 8 < D; /* D % 16 == 8: one vector left */
        __m256i acc[ITQ][2];
        for (int i = 0; i < ITQ; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        if (two)
            pair_products(pc[0], IBK / 2 * 4, vp + (kb / 2) * D + d, D * 4, IBK / 2, acc);
        else
            for (int jp = 0; jp < IBK / 2; jp++) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i*)(vp + (kb / 2 + jp) * D + d));
                for (int i = 0; i < ITQ; i++)
                    acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(_mm256_set1_epi32((int)pc[i][jp]), v0));
            }
        for (int i = 0; i < ITQ; i++) {
            float* orow = o + (t + i) * D + d;
            const __m256 wv = _mm256_set1_ps(w[i]);
            _mm256_storeu_ps(orow, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][0]), wv, _mm256_loadu_ps(orow)));
            if (two)
                _mm256_storeu_ps(orow + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][1]), wv, _mm256_loadu_ps(orow + 8)));
        }
    }
#endif
}

/* Query rows [0, rows) of one head (rows <= IBQ) over all S keys, rotated by their RoPE tables
 * cos, sin (rows cs_tok apart) unless NULL. Returns 1 when q holds a NaN or an infinity. */
static inline __attribute__((always_inline)) int i16_block(const float* q, int64_t q_tok, int64_t rows,
                                                           const float* cos, const float* sin, int64_t cs_tok,
                                                           const uint32_t* kp, const float* ks, const uint32_t* vp,
                                                           const float* vs, int64_t S, int64_t S_pad, float scale2,
                                                           float* out, int64_t o_tok, const int D) {
    uint32_t qc[IBQ * 64] __attribute__((aligned(32)));
    float qs[IBQ], mx[IBQ], l[IBQ], o[IBQ * 128] __attribute__((aligned(32))), turned[128];
    for (int r = 0; r < IBQ; r++) {
        const float *cr = cos ? cos + r * cs_tok : NULL, *sr = sin ? sin + r * cs_tok : NULL;
        const float* qr = r < rows ? rotated(q + r * q_tok, cr, sr, D, turned) : q;
        if (r < rows && !all_finite(qr, D)) return 1;
        const float m = r < rows ? absmax(qr, D) : 0.f;
        const float inv = m > 0.f ? QK_CODE / m : 0.f;
        for (int p = 0; p < D / 2; p++) qc[r * (D / 2) + p] = r < rows ? code_pair(qr[2 * p], qr[2 * p + 1], inv) : 0;
        qs[r] = m / QK_CODE * scale2, mx[r] = -1e30f, l[r] = 0.f;
    }
    memset(o, 0, sizeof(float) * IBQ * D);
    for (int64_t kb = 0; kb < S_pad; kb += IBK)
        for (int t = 0; t < rows; t += ITQ) {
            if (kb + IBK <= S)
                i16_tile(qc, qs, kp, ks[kb / IBK], vp, S, S_pad, t, kb, o, mx, l, D, 0);
            else
                i16_tile(qc, qs, kp, ks[kb / IBK], vp, S, S_pad, t, kb, o, mx, l, D, 1);
        }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = 1.f / l[r];
        for (int d = 0; d < D; d++) out[r * o_tok + d] = o[r * D + d] * vs[d] * inv;
    }
    return 0;
}

/* out = softmax(q k^T / sqrt(D)) v over all S keys (no mask: the vision tower), H heads, all
 * float32 with D contiguous and strides in elements (q[t][h] at t*q_tok + h*q_head, likewise
 * k, v, out), products in 16-bit integer codes as above. D = 64, 72 or 80. cos, sin (or NULL):
 * the tower's RoPE tables [S][D] (rows cs_tok apart; T == S), applied to q and k here, as they
 * are coded: the tower's separate rotation passes cost about 0.6 s at 1024 image tokens.
 * Returns 0, -1 when out of memory, -2 when D is not supported, -3 when q, k or v holds a NaN
 * or an infinity (the caller takes the float path, which carries them as the reference does). */
int qvl_attention_i16(const float* q, const float* k, const float* v, float* out, int64_t T, int64_t S, int64_t H,
                      int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head, int64_t v_tok,
                      int64_t v_head, int64_t o_tok, int64_t o_head, const float* cos, const float* sin,
                      int64_t cs_tok, int threads) {
    if ((D != 64 && D != 72 && D != 80) || (cos && T != S)) return -2;
    const int64_t S_pad = (S + IBK - 1) / IBK * IBK;
    uint32_t* kp = aligned_alloc(32, (size_t)(H * S_pad * D * 2));
    uint32_t* vp = aligned_alloc(32, (size_t)(H * S_pad * D * 2));
    float* ks = malloc((size_t)(H * S_pad / IBK) * sizeof(float));
    float* vs = malloc((size_t)(H * D) * sizeof(float));
    if (!kp || !vp || !ks || !vs) {
        free(kp), free(vp), free(ks), free(vs);
        return -1;
    }
    int bad = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : bad)
    for (int64_t h = 0; h < H; h++)
        bad |= pack_i16(k + h * k_head, k_tok, v + h * v_head, v_tok, cos, sin, cs_tok, S, S_pad, D,
                        kp + h * (D / 2) * S_pad, ks + h * (S_pad / IBK), vp + h * (S_pad / 2) * D, vs + h * D);
    const int64_t blocks = (T + IBQ - 1) / IBQ;
    const float scale2 = 1.4426950408889634f / sqrtf((float)D); /* softmax in base 2 */
    if (!bad) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : bad)
        for (int64_t item = 0; item < H * blocks; item++) {
            const int64_t h = item / blocks, r0 = item % blocks * IBQ, rows = T - r0 < IBQ ? T - r0 : IBQ;
            const float* qh = q + r0 * q_tok + h * q_head;
            const float *cr = cos ? cos + r0 * cs_tok : NULL, *sr = sin ? sin + r0 * cs_tok : NULL;
            float* oh = out + r0 * o_tok + h * o_head;
            const uint32_t *kh = kp + h * (D / 2) * S_pad, *vh = vp + h * (S_pad / 2) * D;
            if (D == 64)
                bad |= i16_block(qh, q_tok, rows, cr, sr, cs_tok, kh, ks + h * (S_pad / IBK), vh, vs + h * D, S, S_pad,
                                 scale2, oh, o_tok, 64);
            else if (D == 72)
                bad |= i16_block(qh, q_tok, rows, cr, sr, cs_tok, kh, ks + h * (S_pad / IBK), vh, vs + h * D, S, S_pad,
                                 scale2, oh, o_tok, 72);
            else
                bad |= i16_block(qh, q_tok, rows, cr, sr, cs_tok, kh, ks + h * (S_pad / IBK), vh, vs + h * D, S, S_pad,
                                 scale2, oh, o_tok, 80);
        }
    }
    free(kp), free(vp), free(ks), free(vs);
    return bad ? -3 : 0;
}
#else
int qvl_attention_i16(const float* q, const float* k, const float* v, float* out, int64_t T, int64_t S, int64_t H,
                      int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head, int64_t v_tok,
                      int64_t v_head, int64_t o_tok, int64_t o_head, const float* cos, const float* sin,
                      int64_t cs_tok, int threads) {
    (void)q, (void)k, (void)v, (void)out, (void)T, (void)S, (void)H, (void)D, (void)q_tok, (void)q_head, (void)k_tok,
        (void)k_head, (void)v_tok, (void)v_head, (void)o_tok, (void)o_head, (void)cos, (void)sin, (void)cs_tok,
        (void)threads;
    return -2;
}
#endif


/* 2^x for x <= 0 in plain C that the compiler vectorises (relative error ~2e-6). */
static inline float exp2_poly(float x) {
    x = x < -126.f ? -126.f : x;
    const int32_t n = round_int(x);
    const float f = x - (float)n;
    float p = 1.3534167e-3f;
    p = p * f + 9.6588929e-3f;
    p = p * f + 5.5503406e-2f;
    p = p * f + 2.4022217e-1f;
    p = p * f + 6.9314699e-1f;
    p = p * f + 1.f;
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += n * (1 << 23);
    memcpy(&p, &bits, 4);
    return p;
}

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
