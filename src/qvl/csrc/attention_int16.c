/* The vision tower's attention in 16-bit integer codes (AVX2, AVX-512): qvl_attention_i16. */
#include "common.h"
#include "int_products.h"

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
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : bad)
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
