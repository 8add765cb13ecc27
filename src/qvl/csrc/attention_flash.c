/* Flash attention in AVX512-BF16: the vision tower's and causal prefill's over the paged KV
 * cache (qvl_attention), and the vision tower's in 8-bit integer codes with AVX-512 VNNI
 * (qvl_attention_q8), which shares its blocking. */
#include "common.h"
#include "int_products.h"

#if defined(QVL_AVX512) && defined(__AVX512BF16__) && defined(__AVX512DQ__) /* DQ: exp2_ps3 (every BF16 CPU has it) */
#define ABK 64 /* keys per step */
#define ATQ 4  /* query rows per tile (ATQ x ABK/16 score accumulators) */
#define ABQ 64 /* query rows per block (its keys and values stay in L1 across the tiles; L2 at D 256) */
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
    const int CW = DV <= 128 ? DV : 128; /* value-product columns at a time (D 256: two halves) */
    const int GR = CW <= 80 ? 4 : 2;     /* rows per value-product group: GR x CW/16 accumulators */
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
    for (int c0 = 0; c0 < DV; c0 += CW)
        for (int g = 0; g < ATQ; g += GR) {
            __m512 acc[4][8];
            float* og = o + (t + g) * DV + c0;
            for (int i = 0; i < GR; i++)
                for (int d = 0; d < CW / 16; d++) {
                    __m512 prev = _mm512_loadu_ps(og + i * DV + 16 * d);
                    acc[i][d] = corr[g + i] == 1.f ? prev : _mm512_mul_ps(prev, _mm512_set1_ps(corr[g + i]));
                }
            for (int jp = 0; jp < ABK / 2; jp++) {
                const uint32_t* vrow = vp + (kb / 2 + jp) * DV + c0;
                for (int i = 0; i < GR; i++) {
                    __m512bh a = (__m512bh)_mm512_set1_epi32((int)((const uint32_t*)(pb + (g + i) * ABK))[jp]);
                    for (int d = 0; d < CW / 16; d++)
                        acc[i][d] = _mm512_dpbf16_ps(acc[i][d], a, (__m512bh)_mm512_loadu_si512(vrow + 16 * d));
                }
            }
            for (int i = 0; i < GR; i++)
                for (int d = 0; d < CW / 16; d++) _mm512_storeu_ps(og + i * DV + 16 * d, acc[i][d]);
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
    uint16_t qb[ABQ * 256] __attribute__((aligned(64)));
    uint8_t qc[ABQ * 128] __attribute__((aligned(64))); /* with bs: each row's codes + 128 */
    float qf[ABQ];                                      /* with bs: each row's step x scale2 */
    float o[ABQ * 256] __attribute__((aligned(64)));
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

/* attention_block for a head size known at run time (D 32, 64, 72, 80, 128 or 256). */
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
    else if (D == 128)
        attention_block(q, q_stride, rows, kp, vp, S, S_pad, causal, scale2, out, out_stride, bs, 128);
    else /* Qwen3.5's full-attention layers */
        attention_block(q, q_stride, rows, kp, vp, S, S_pad, causal, scale2, out, out_stride, bs, 256);
}

/* out = softmax(q k^T / sqrt(D)) v for T queries over S keys, grouped-query (query head h
 * uses key/value head h / (H / Hkv)). Every tensor is bf16 with D contiguous and strides
 * in elements: q[t][h] at t*q_tok + h*q_head, likewise k, v (positions j), out. With a block
 * table (a paged KV cache; NULL: positions as strided above), position j of k or v is at
 * kv_blocks[j/block]*block_stride + (j%block)*k_tok (v_tok) + h*k_head (v_head); block % 16 == 0.
 * causal >= 0: query t sees keys j <= causal + t (prefill of positions causal..causal+T-1
 * over a cache of S = causal + T); -1: no mask (vision). D = 32, 64, 128 or 256 (Qwen3.5's full
 * attention), and 72 or 80 for vision; where the process has AMX tiles, attention runs only on
 * them (qvl_amx_attention, even D <= 128; -2 otherwise, and the caller takes torch's SDPA),
 * except causal calls over fewer keys than causal + T (query t then sees keys up to
 * min(causal + t, S - 1)), which these dot products take.
 * Returns 0, -1 when out of memory, -2 when D or the heads are not supported. */
int qvl_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t T, int64_t S,
                  int64_t H, int64_t Hkv, int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                  int64_t v_tok, int64_t v_head, int64_t o_tok, int64_t o_head, int64_t causal, const int64_t* kv_blocks,
                  int64_t block, int64_t block_stride, int threads) {
    if (qvl_int8_amx_ready() && (causal < 0 || causal + T <= S)) /* tiles: several times these dot products */
        return qvl_amx_attention(q, k, v, out, T, S, H, Hkv, D, q_tok, q_head, k_tok, k_head, v_tok, v_head, o_tok,
                                 o_head, causal, kv_blocks, block, block_stride, threads);
    const int vision_only = D == 72 || D == 80; /* the 1152-wide towers' heads (8B and larger) */
    if ((D != 32 && D != 64 && D != 128 && D != 256 && !(vision_only && causal < 0 && !kv_blocks)) || Hkv < 1 || H % Hkv != 0 ||
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
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
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
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
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
