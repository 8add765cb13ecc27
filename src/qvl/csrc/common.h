/* Shared by qvl's kernel files: the instruction-set tier this build targets, bf16 <-> float32,
 * dtype-generic element access and small vector helpers.
 *
 * The tier is fixed at compile time by the -march/-mcpu flags qvl/kernels/build.py passes:
 *   QVL_AVX512  AVX-512 F/BW/VL (+ __AVX512VNNI__, __AVX512BF16__ where the flags include them)
 *   QVL_AVX2    AVX2 + FMA, no AVX-512 (+ __AVXVNNI__ on Alder Lake and later)
 *   QVL_NEON    AArch64 Advanced SIMD (+ __ARM_FEATURE_DOTPROD, __ARM_FEATURE_MATMUL_INT8)
 *   none        portable C, vectorised by the compiler for whatever the flags allow (also
 *               with -DQVL_PORTABLE, which tests and QVL_ISA=portable use to force it) */
#ifndef QVL_COMMON_H
#define QVL_COMMON_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(QVL_PORTABLE)
/* portable C only: the compiler vectorises it for the flags it was given */
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QVL_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define QVL_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define QVL_NEON 1
#include <arm_neon.h>
#endif

enum { F32 = 0, BF16 = 1 };
enum { W_BF16 = 0, W_INT8 = 1, W_INT4 = 2 };
#define TILE 4     /* activation rows sharing one pass over a weight row */
#define CHUNK 128  /* columns per activation scale of the integer products */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch does (NaN kept quiet); one expression without a branch, so
 * that loops over it vectorise. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf(float v) { return bf16_to_f32(f32_to_bf16(v)); }

static inline float get(const void* p, int dt, int64_t i) {
    return dt == BF16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void put(void* p, int dt, int64_t i, float v) {
    if (dt == BF16)
        ((uint16_t*)p)[i] = f32_to_bf16(v);
    else
        ((float*)p)[i] = v;
}

static inline float in_dt(float v, int dt) { return dt == BF16 ? round_bf(v) : v; } /* as torch stores it */

/* Round to nearest (ties away from zero); unlike lrintf, loops over it vectorise. */
static inline int32_t round_int(float v) { return (int32_t)(v + (v >= 0.f ? 0.5f : -0.5f)); }

/* 2^x for x <= 0 in plain C that the compiler vectorises (relative error ~2e-6; 2^-126 below
 * -126): rounded to the nearest integer by adding and taking away 1.5 * 2^23 (a conversion to
 * int with a branch on the sign, as round_int does, keeps loops over it from vectorising). */
static inline float exp2_poly(float x) {
    x = x < -126.f ? -126.f : x;
    const float n = (x + 12582912.f) - 12582912.f, f = x - n;
    float p = 1.3534167e-3f;
    p = p * f + 9.6588929e-3f;
    p = p * f + 5.5503406e-2f;
    p = p * f + 2.4022217e-1f;
    p = p * f + 6.9314699e-1f;
    p = p * f + 1.f;
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += (int32_t)n * (1 << 23);
    memcpy(&p, &bits, 4);
    return p;
}

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

/* Whether x[0..n) holds no NaN or infinity. */
static inline int all_finite(const float* x, int64_t n) {
    int ok = 1;
#pragma omp simd reduction(& : ok)
    for (int64_t i = 0; i < n; i++) ok &= fabsf(x[i]) <= FLT_MAX;
    return ok;
}

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

#ifdef __AVX512DQ__
static inline __m512 exp2_ps3(__m512 x) { /* 2^x within 8e-5 (degree 3: for results rounded to bf16) */
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); /* x - floor(x) */
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(7.79071638e-2f), f, _mm512_set1_ps(2.26233194e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.95777096e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99927827e-1f));
    return _mm512_scalef_ps(p, x); /* p * 2^floor(x); x of -1e30 (masked keys) gives 0 */
}
#endif

static inline __m512 div_one_plus_exp2(__m512 x, __m512 t) { /* x / (1 + 2^t): SiLU */
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp2_ps(t)));
}

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

/* r[i] (row i of a 16 x 16 float32 block) -> r[j] = column j, in registers. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    }
}

/* One head's keys as pairs kh [DP/2][kh_stride] (k[n][2p], k[n][2p+1]) in columns 0..S_pad:
 * the B tiles of amx_attention.c's scores and the operand of attention_flash.c's dot products
 * (which packs a paged cache block by block into one kh). 16 keys by 16 pairs at a time, transposed in
 * registers; zero past S and past D. S_pad % 16 == 0, DP % 32 == 0. */
static inline void pack_keys(const uint16_t* k, int64_t k_tok, int64_t S, int64_t S_pad, int64_t D, int64_t DP,
                      uint32_t* kh, int64_t kh_stride) {
    for (int64_t n = 0; n < S_pad; n += 16)
        for (int64_t p = 0; p < DP / 2; p += 16) {
            const int64_t pairs = D / 2 - p; /* valid pairs in this block */
            const __mmask16 m = pairs >= 16 ? 0xFFFF : pairs <= 0 ? 0 : (__mmask16)((1u << pairs) - 1);
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = n + i < S ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(m, k + (n + i) * k_tok + 2 * p))
                                 : _mm512_setzero_ps();
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_ps((float*)(kh + (p + j) * kh_stride + n), r[j]);
        }
}

/* One head's values as pairs vh [S_pad/2][DV] (v[2j][d], v[2j+1][d]): the B tiles of
 * amx_attention.c's value product and attention_flash.c's operand; zero past S and past D. DV % 16 == 0. */
static inline void pack_values(const uint16_t* v, int64_t v_tok, int64_t S, int64_t S_pad, int64_t D, int64_t DV,
                        uint32_t* vh) {
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < S_pad; j += 2)
        for (int64_t d = 0; d < DV; d += 32) {
            const int64_t cols = D - d;
            const __mmask32 m = cols >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << cols) - 1);
            const __m512i a = j < S ? _mm512_maskz_loadu_epi16(m, v + j * v_tok + d) : _mm512_setzero_si512();
            const __m512i b = j + 1 < S ? _mm512_maskz_loadu_epi16(m, v + (j + 1) * v_tok + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(vh + (j / 2) * DV + d, _mm512_permutex2var_epi16(a, first, b));
            if (d + 16 < DV) _mm512_storeu_si512(vh + (j / 2) * DV + d + 16, _mm512_permutex2var_epi16(a, second, b));
        }
}

/* One head's keys (pack_keys: group of 16 keys n at kh + n * kh_group, pair rows kh_stride
 * apart) and values (pack_values into vh [S_pad/2][DV]), 16 positions at a time, position j
 * at j * tok or, with a block table (block % 16 == 0), at kv_blocks[j / block] * block_stride +
 * (j % block) * tok; zeros past S. The flash kernels' one way of reading a cache. */
static inline void pack_head(const uint16_t* k, int64_t k_tok, const uint16_t* v, int64_t v_tok, int64_t S,
                             int64_t S_pad, int64_t D, int64_t DP, int64_t DV, const int64_t* kv_blocks, int64_t block,
                             int64_t block_stride, uint32_t* kh, int64_t kh_group, int64_t kh_stride, uint32_t* vh) {
    for (int64_t n = 0; n < S_pad; n += 16) {
        const int64_t seen = S - n < 16 ? S - n : 16, base = n >= S || !kv_blocks ? 0 : kv_blocks[n / block] * block_stride;
        const int64_t j = kv_blocks ? n % block : n; /* position n's index in its storage */
        pack_keys(k + (seen > 0 ? base + j * k_tok : 0), k_tok, seen, 16, D, DP, kh + n * kh_group, kh_stride);
        pack_values(v + (seen > 0 ? base + j * v_tok : 0), v_tok, seen, 16, D, DV, vh + (n / 2) * DV);
    }
}

#ifdef __AVX512BF16__
/* out[0..16) = v rounded to bf16, then, when res is given, res + that, rounded again (a layer's
 * output added to the residual stream, as `res + y` in bf16 would). */
static inline void store16_bf16(__m512 v, const uint16_t* res, uint16_t* out) {
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    if (res)
        h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(bf16x16_to_ps(h), bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)res))));
    _mm256_storeu_si256((__m256i*)out, h);
}

/* 16 outputs of the int8 x int8 rescale (qvl_rescale_row): cs * (rs * a + lo * colsum) + b,
 * tanh-GELU when `gelu`, then stored as store16_bf16 does. */
static inline void rescale16_bf16(__m512 a, __m512 rs, __m512 lo, __m512 cs, __m512 colsum, __m512 b, int gelu,
                                  const uint16_t* res, uint16_t* out) {
    __m512 v = _mm512_fmadd_ps(cs, _mm512_add_ps(_mm512_mul_ps(rs, a), _mm512_mul_ps(lo, colsum)), b);
    if (gelu) v = gelu_tanh_ps(v);
    store16_bf16(v, res, out);
}
#endif
#endif

#if defined(QVL_AVX2) || defined(QVL_AVX512) /* the AVX-512 tier has AVX2 too */
static inline __m256 bf16x8_to_ps(__m128i h) { /* 8 bf16 -> 8 float32, exactly */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 exp2_ps256(__m256 x) { /* 2^x, x clamped to [-126, 127]: exp2_ps's polynomial */
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-126.f)), _mm256_set1_ps(127.f));
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.3534167e-3f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6588929e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5503406e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022217e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314699e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

static inline __m256 div_one_plus_exp2_256(__m256 x, __m256 t) { /* x / (1 + 2^t): SiLU and tanh-GELU */
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp2_ps256(t)));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#ifdef QVL_NEON
static inline float32x4_t exp2_f32x4(float32x4_t x) { /* 2^x, x clamped to [-126, 127]: exp2_ps256's steps */
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-126.f)), vdupq_n_f32(127.f));
    const float32x4_t n = vrndnq_f32(x), f = vsubq_f32(x, n);
    float32x4_t p = vdupq_n_f32(1.3534167e-3f);
    p = vfmaq_f32(vdupq_n_f32(9.6588929e-3f), p, f);
    p = vfmaq_f32(vdupq_n_f32(5.5503406e-2f), p, f);
    p = vfmaq_f32(vdupq_n_f32(2.4022217e-1f), p, f);
    p = vfmaq_f32(vdupq_n_f32(6.9314699e-1f), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.f), p, f);
    const int32x4_t e = vshlq_n_s32(vcvtq_s32_f32(n), 23);
    return vreinterpretq_f32_s32(vaddq_s32(vreinterpretq_s32_f32(p), e));
}
#endif

/* One linear of a decoder layer, as qvl_linear takes it, and one decoder layer's weights
 * (QvlLinear / QvlLayer mirror native.LinearArgs / native.LayerArgs). */
typedef struct {
    int64_t kind, n, k, group_size;
    const void *w, *scale, *zero, *bias;
} QvlLinear;

/* A mixture-of-experts MLP (experts 0 in a dense layer): the router [experts][D] (bf16 weights)
 * and each expert's gate_up [2 * inter][D] (gate rows first) and down [D][inter]; Qwen3.5's
 * shared expert's score shared_gate [1][D] (n 0: none; the expert is the layer's gate/up/down). */
typedef struct {
    int64_t experts, top_k, inter;
    QvlLinear router;
    const QvlLinear *gate_up, *down; /* [experts] each */
    QvlLinear shared_gate;
} QvlMoe;

/* A Gated DeltaNet layer's weights (Qwen3.5): in_proj_qkv [C][D] (C = 2 Hk Dk + Hv Dv),
 * in_proj_z [Hv Dv][D], in_proj_b and in_proj_a [Hv][D], out_proj [D][Hv Dv]; conv1d's weight
 * [C][K], dt_bias and A_log [Hv], the gated norm's weight [Dv], all of the compute dtype. */
typedef struct {
    QvlLinear qkv, z, b, a, out;
    const void *conv, *dt_bias, *a_log, *norm;
} QvlDelta;

/* One decoder layer: attention (q, k, v, o, the q/k norms) or, where delta.out.n != 0, a Gated
 * DeltaNet; then a dense MLP (gate, up, down) or a mixture (moe.experts != 0; gate/up/down
 * its shared expert where it has one). */
typedef struct {
    const void *input_norm, *post_norm, *q_norm, *k_norm;
    QvlLinear q, k, v, o, gate, up, down;
    QvlMoe moe;
    QvlDelta delta;
} QvlLayer;

/* The model's shapes for qvl_decode_layers: hidden size D, attention heads H and key/value heads
 * Hkv of hd dims, the first rotary_dim of them rotated; gated: q_proj gives each head's query
 * then its output gate (Qwen3.5); zero_centred: the RMSNorms scale by (1 + w); the Gated
 * DeltaNet's key heads Hk of Dk, value heads Hv of Dv and convolution width K (0 without). */
typedef struct {
    int64_t D, H, Hkv, hd, rotary_dim, gated, zero_centred, Hk, Hv, Dk, Dv, K;
    float eps;
} QvlShape;

/* The Gated DeltaNet layers' states (qvl.state_cache.StatePool): conv [L][slots][C][K-1] of the
 * compute dtype, recurrent [L][slots][Hv][Dk][Dv] float32 (L: the DeltaNet layers), row b's at
 * slot rows[b]. */
typedef struct {
    void* conv;
    float* recurrent;
    int64_t slots;
    const int64_t* rows;
} QvlStates;

/* One query per row against the paged KV cache (qvl_decode_attention's arguments). */
typedef struct {
    const void *q, *keys, *values;
    int dt;
    const int64_t* table;
    int64_t table_stride, block, block_stride, head_stride, B, H, Hkv;
    const int64_t* lengths;
    int64_t D;
    void* out;
} QvlAttention;

/* The Gated DeltaNet's decode step (qvl_gated_delta_step's arguments). */
typedef struct {
    const void *q, *k, *v;
    int dt;
    int64_t B, Hk, Hv, Dk, Dv, q_tok, q_head, k_tok, k_head, v_tok, v_head;
    const float *g, *beta;
    float* states;
    const int64_t* slots;
    void* out;
} QvlDeltaStep;

/* Entry points shared between the files (each defined once). */
int qvl_linear(int kind, const void* x, int dt, int64_t M, int64_t K, int64_t N, const void* w, const void* scale,
               const void* zero, int64_t gs, const void* bias, void* y, int threads);
int qvl_decode_attention(const void* q, const void* keys, const void* values, int dt, const int64_t* table,
                         int64_t table_stride, int64_t block, int64_t block_stride, int64_t head_stride, int64_t B,
                         int64_t H, int64_t Hkv, const int64_t* lengths, int64_t D, void* out, int threads);
void qvl_silu_mul(void* g, const void* u, int dt, int64_t n, int threads);
void qvl_text_rope_rows(void* x, int dt, int64_t heads, int64_t D, const void* cos, const void* sin);
void qvl_rmsnorm(const void* x, const void* w, void* out, int dt, int64_t rows, int64_t dim, float eps, int threads);
void qvl_rmsnorm_zero_centred(const void* x, const void* w, void* out, int dt, int64_t rows, int64_t dim, float eps,
                              int threads);
void qvl_gated_rmsnorm(const void* x, const void* z, const void* w, void* out, int dt, int64_t rows, int64_t dim,
                       float eps, int threads);
int qvl_features(void);
int qvl_int8_amx_ready(void);
int qvl_amx_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t T, int64_t S,
                      int64_t H, int64_t Hkv, int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                      int64_t v_tok, int64_t v_head, int64_t o_tok, int64_t o_head, int64_t causal,
                      const int64_t* kv_blocks, int64_t block, int64_t block_stride, int threads);
/* The decode GEMV's activation codes split for AMX tiles (amx_gemm.c): high bytes, low bytes and
 * the chunks' scales laid out as the tiles' sums are. */
typedef struct {
    int8_t* hi;
    uint8_t* lo;
    float* rep;
    int64_t M, K;
} AmxCodes;
int64_t qvl_amx_codes_bytes(int64_t M, int64_t K); /* 0: no AMX tiles here, or K not whole chunks */
void qvl_amx_codes(const int16_t* q, const float* xs, int64_t M, int64_t K, char* mem, AmxCodes* a);
void qvl_amx_block(const AmxCodes* a, const int8_t* w, int64_t b, float* own);
void qvl_amx_write(const AmxCodes* a, const float* own, const void* scale, const void* bias, int dt, int64_t b,
                   int64_t N, void* y);
void qvl_thread_done(void); /* at the end of a thread's part in a team region (team.c): its AMX tiles released */
void qvl_rescale_row(const float* a, float rs, float lo, const float* colsum, const float* cs, const float* b, int dt,
                     int64_t N, int gelu, const void* res, void* y, float* tmp);
int qvl_rescale_columns(const void* col_scale, const void* bias, int dt, int64_t N, float** cs, float** b);
void qvl_layer_norm_row(float* row, int64_t K, const float* nw, const float* nb, float eps, int dt);
void qvl_gelu_tanh(float* v, int64_t n);
int qvl_q8_levels(void); /* the byte kernel's top activation code: 127, 63 on plain AVX2 (0: not built) */
int qvl_q8_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const int8_t* w, const void* scale,
                  const void* bias, void* y, int threads, int group, const void* norm_w, const void* norm_b, float eps,
                  int gelu, const void* residual);
int qvl_q4_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const uint8_t* w, const void* scale,
                  const void* zero, int64_t gs, const void* bias, void* y, int threads, int group);
void qvl_dequantize(int kind, const void* w, const void* scale, const void* zero, int64_t gs, int64_t N, int64_t K,
                    int dt, void* out, int threads);
int qvl_gated_delta_step(const void* q, const void* k, const void* v, int dt, int64_t B, int64_t Hk, int64_t Hv,
                         int64_t Dk, int64_t Dv, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                         int64_t v_tok, int64_t v_head, const float* g, const float* beta, float* states,
                         const int64_t* slots, void* out, int threads);
int qvl_causal_conv_step(const void* x, int dt, int64_t B, int64_t C, int64_t x_tok, const void* w, int64_t K,
                         void* states, const int64_t* slots, void* out, int threads);
int qvl_decode_layers(const QvlLayer* layers, int64_t n_layers, const QvlShape* s, void* x, int dt, int64_t B,
                      const void* cos, const void* sin, void* keys, void* values, int64_t layer_stride,
                      const int64_t* table, int64_t table_stride, int64_t block, int64_t block_stride,
                      int64_t head_stride, const int64_t* slots, const QvlStates* states, int threads);

#endif
