/* Flash attention on AMX-BF16 tiles (qvl_amx_attention). */
#include "common.h"
#include "amx_tiles.h"

#if defined(QVL_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QVL_AMX_ATTENTION 1
/* Flash attention on AMX-BF16 tiles, 16 query rows at a time: the vision tower's (every query
 * sees every key) and prefill's (causal, over the paged cache). Per 32 keys: the scores (q . k
 * in float32 over D, two 16 x 16 tiles) go to memory for the online softmax in AVX-512 (base 2;
 * the running max moves only past AMX_SLACK, as in attention_flash.c), whose bf16 probabilities are
 * the A tile of the value product, accumulated over all keys. The next 32 keys' scores are
 * issued before this block's softmax, so the tiles and the vector units work at once. D up to
 * 128 (vision 64-80, text 128): q and k are zero-padded to a multiple of 32 columns, the values
 * to a multiple of 16. Tiles: output columns 0..79 in tiles 0-4 (0..63 in 0-3 when D > 80),
 * scores 5, q / probabilities 6, keys / values 7; past those columns (D > 80) the sums stay in
 * memory and pass through tile 4 each block. A query row's result depends on its own scores
 * only: key blocks from 0 in the same order whatever the other rows, and a block masked for it
 * adds exact zeros; so a prompt token computes alike in any prefill slice. */
#define AMX_SLACK 8.f

#define OUT_TILES(op) \
    do { op(0); if (NP > 1) op(1); if (NP > 2) op(2); if (NP > 3) op(3); if (NP > 4) op(4); } while (0)
#define ZERO_OUT(t) _tile_zero(t)
#define STORE_OUT(t) _tile_stored(t, ob + 16 * t, DV * 4)
#define LOAD_OUT(t) _tile_loadd(t, ob + 16 * t, DV * 4)
#define VALUES(t) { _tile_loadd(7, vb + 16 * t, DV * 4); _tile_dpbf16ps(t, 6, 7); }
#define VALUES_IN_MEMORY(t) { _tile_loadd(4, ob + 16 * t, DV * 4); _tile_loadd(7, vb + 16 * t, DV * 4); \
                              _tile_dpbf16ps(4, 6, 7); _tile_stored(4, ob + 16 * t, DV * 4); }

/* Scores of the 16 query rows (qb [DP/32][16][32]) against keys kb..kb+31 -> sc [16][32];
 * kp [S_pad/16][DP/2][16] key pairs: each B tile (16 pairs of 16 keys) is 1 KB in one piece. */
static inline void amx_scores(const uint16_t* qb, const uint32_t* kp, int64_t kb, int64_t DP, float* sc) {
    for (int half = 0; half < 2; half++) {
        _tile_zero(5);
        for (int64_t c = 0; c < DP / 32; c++) {
            _tile_loadd(6, qb + c * 512, 64);
            _tile_loadd(7, kp + ((kb / 16 + half) * (DP / 2) + 16 * c) * 16, 64);
            _tile_dpbf16ps(5, 6, 7);
        }
        _tile_stored(5, sc + 16 * half, 128);
    }
}

static inline __mmask16 first_keys(int64_t n) { /* the lanes of the first n of 16 keys */
    return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

/* The online softmax of one block of scores (sc [16][32]) -> bf16 probabilities pb [16][32];
 * sums l, maxima mx (scaled; raw: the unscaled score that would move it) and corrections corr
 * per row; returns whether a row's max moved after its first block. Row i sees the block's
 * first left + step * i keys (vision: step 0, left the keys below S; causal: step 1); masked = 0
 * when every row sees all 32. */
static inline __attribute__((always_inline)) int amx_softmax(const float* sc, int64_t left, int64_t step, float scale2,
                                                             float* mx, float* raw, float* corr, __m512* l,
                                                             uint16_t* pb, const int masked) {
    const __m512 scale = _mm512_set1_ps(scale2), low = _mm512_set1_ps(-1e30f);
    const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3F803F80); /* bf16 pairs of 1 */
    int rescale = 0;
    for (int i = 0; i < 16; i++) {
        const __mmask16 m0 = masked ? first_keys(left + step * i) : 0xFFFF;
        const __mmask16 m1 = masked ? first_keys(left + step * i - 16) : 0xFFFF;
        /* unscaled scores: scale > 0 commutes with the max; x * scale - max is one FMA below */
        const __m512 a = masked ? _mm512_mask_mov_ps(low, m0, _mm512_load_ps(sc + 32 * i)) : _mm512_load_ps(sc + 32 * i);
        const __m512 b = masked ? _mm512_mask_mov_ps(low, m1, _mm512_load_ps(sc + 32 * i + 16))
                                : _mm512_load_ps(sc + 32 * i + 16);
        const __m512 top = _mm512_max_ps(a, b);
        corr[i] = 1.f;
        if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(raw[i]), _CMP_GT_OQ)) {
            const float now = _mm512_reduce_max_ps(top) * scale2;
            if (mx[i] > -1e29f) corr[i] = exp2f(mx[i] - now), rescale = 1;
            l[i] = _mm512_mul_ps(l[i], _mm512_set1_ps(corr[i]));
            mx[i] = now, raw[i] = (now + AMX_SLACK) / scale2;
        }
        const __m512 m = _mm512_set1_ps(mx[i]);
        const __m512bh p = _mm512_cvtne2ps_pbh(exp2_ps3(_mm512_fmsub_ps(b, scale, m)),
                                               exp2_ps3(_mm512_fmsub_ps(a, scale, m)));
        l[i] = _mm512_dpbf16_ps(l[i], p, ones); /* summed as the value product weighs them */
        _mm512_store_si512(pb + 32 * i, (__m512i)p);
    }
    return rescale;
}

/* Query rows (up to 16) of one head: qb [DP/32][16][32] bf16 (zero-padded); kp [S_pad/16][DP/2][16]
 * key pairs; vp [S_pad/2][DV] value pairs; out rows `out_stride` apart, D columns. causal >= 0:
 * row i sits at position causal + i and sees keys 0..causal + i; -1: every row sees all S. */
static void amx_attention_rows(const uint16_t* qb, int64_t rows, const uint32_t* kp, const uint32_t* vp, int64_t S,
                               int64_t S_pad, int64_t D, int64_t DP, int64_t DV, int64_t causal, float scale2,
                               uint16_t* out, int64_t out_stride) {
    const int ND = (int)(DV / 16), NP = ND > 5 ? 4 : ND; /* output tiles; those past NP in memory */
    float sc[2][16 * 32] __attribute__((aligned(64))), ob[16 * 128] __attribute__((aligned(64)));
    uint16_t pb[16 * 32] __attribute__((aligned(64)));
    float mx[16], raw[16], corr[16];
    __m512 l[16];
    for (int i = 0; i < 16; i++) mx[i] = raw[i] = -1e30f, l[i] = _mm512_setzero_ps();
    if (NP < ND) memset(ob, 0, sizeof ob);
    OUT_TILES(ZERO_OUT);
    /* keys below `seen` (a multiple of 32 past the last row's last key) */
    const int64_t seen = causal < 0 ? S_pad : (causal + rows + 31) / 32 * 32 < S_pad ? (causal + rows + 31) / 32 * 32 : S_pad;
    amx_scores(qb, kp, 0, DP, sc[0]);
    for (int64_t kb = 0; kb < seen; kb += 32) {
        const float* cur = sc[(kb / 32) & 1];
        if (kb + 32 < seen) amx_scores(qb, kp, kb + 32, DP, sc[((kb / 32) + 1) & 1]);
        const int64_t left = causal < 0 ? S - kb : causal + 1 - kb, step = causal < 0 ? 0 : 1;
        const int rescale = left >= 32 ? amx_softmax(cur, 32, 0, scale2, mx, raw, corr, l, pb, 0)
                                       : amx_softmax(cur, left, step, scale2, mx, raw, corr, l, pb, 1);
        if (rescale) { /* a row's max moved: its output so far is scaled down to the new max */
            OUT_TILES(STORE_OUT);
            for (int i = 0; i < 16; i++)
                if (corr[i] != 1.f)
                    for (int64_t d = 0; d < DV; d += 16)
                        _mm512_storeu_ps(ob + i * DV + d,
                                         _mm512_mul_ps(_mm512_loadu_ps(ob + i * DV + d), _mm512_set1_ps(corr[i])));
            OUT_TILES(LOAD_OUT);
        }
        const uint32_t* vb = vp + (kb / 2) * DV;
        _tile_loadd(6, pb, 64);
        OUT_TILES(VALUES);
        for (int t = NP; t < ND; t++) VALUES_IN_MEMORY(t);
    }
    OUT_TILES(STORE_OUT);
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
        for (int64_t d = 0; d < D; d += 16) {
            const __mmask16 m = D - d >= 16 ? 0xFFFF : (__mmask16)((1u << (D - d)) - 1);
            _mm256_mask_storeu_epi16(out + r * out_stride + d, m,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(ob + r * DV + d), inv)));
        }
    }
}

/* softmax(q k^T / sqrt(D)) v for T queries over S keys, grouped heads, with the arguments of
 * qvl_attention: causal -1 (the vision tower: no mask) or causal prefill over a cache of S =
 * causal + T (or more: keys past the last query's position are not read), the keys and values
 * strided or through a block table (kv_blocks; block % 16 == 0). Returns 0, -1 when out of
 * memory, -2 when the CPU or D does not suit it (odd, or > 128) or S < causal + T. */
int qvl_amx_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t T, int64_t S,
                      int64_t H, int64_t Hkv, int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                      int64_t v_tok, int64_t v_head, int64_t o_tok, int64_t o_head, int64_t causal,
                      const int64_t* kv_blocks, int64_t block, int64_t block_stride, int threads) {
    if (!qvl_int8_amx_ready() || D > 128 || D % 2 || D < 2 || Hkv < 1 || H % Hkv || S < 1 || T < 1 ||
        (kv_blocks && (block < 16 || block % 16)) || (causal >= 0 && causal + T > S))
        return -2;
    const int64_t S_pad = (S + 31) / 32 * 32, DP = (D + 31) / 32 * 32, DV = (D + 15) / 16 * 16, G = H / Hkv;
    const int64_t blocks = (T + 15) / 16;
    uint32_t* kp = aligned_alloc(64, (size_t)(Hkv * S_pad * DP * 2));
    uint32_t* vp = aligned_alloc(64, (size_t)(Hkv * S_pad * DV * 2));
    uint16_t* qp = aligned_alloc(64, (size_t)(H * blocks * 16 * DP * 2));
    if (!kp || !vp || !qp) {
        free(kp), free(vp), free(qp);
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < Hkv; h++) {
        /* keys 16 at a time, [DP/2][16] each (one tile in one piece) */
        pack_head(k + h * k_head, k_tok, v + h * v_head, v_tok, S, S_pad, D, DP, DV, kv_blocks, block, block_stride,
                  kp + h * (DP / 2) * S_pad, DP / 2, 16, vp + h * (S_pad / 2) * DV);
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < H * blocks; item++) { /* [DP/32][16][32] per 16 query rows of a head */
        const int64_t h = item / blocks, r0 = (item % blocks) * 16;
        uint16_t* qb = qp + item * 16 * DP;
        for (int64_t c = 0; c < DP / 32; c++) {
            const int64_t cols = D - c * 32;
            const __mmask32 m = cols >= 32 ? 0xFFFFFFFFu : cols <= 0 ? 0 : (__mmask32)((1u << cols) - 1);
            for (int64_t r = 0; r < 16; r++)
                _mm512_store_si512(qb + (c * 16 + r) * 32,
                                   r0 + r < T ? _mm512_maskz_loadu_epi16(m, q + (r0 + r) * q_tok + h * q_head + c * 32)
                                              : _mm512_setzero_si512());
        }
    }
    const float scale2 = 1.4426950408889634f / sqrtf((float)D); /* softmax in base 2 */
#pragma omp parallel num_threads(threads)
    {
        configure_full_tiles();
        /* head by head (its keys and values stay in L2); causal: within a head the last (longest)
         * query blocks first, so the dynamic schedule balances */
#define AMX_ROWS(h, b)                                                                                            \
    amx_attention_rows(qp + ((h) * blocks + (b)) * 16 * DP, T - (b) * 16 < 16 ? T - (b) * 16 : 16,                    \
                       kp + ((h) / G) * (DP / 2) * S_pad, vp + ((h) / G) * (S_pad / 2) * DV, S, S_pad, D, DP, DV,   \
                       causal < 0 ? -1 : causal + (b) * 16, scale2, out + (b) * 16 * o_tok + (h) * o_head, o_tok)
        if (causal < 0) {
#pragma omp for schedule(static)
            for (int64_t item = 0; item < H * blocks; item++) AMX_ROWS(item / blocks, item % blocks);
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < H * blocks; item++) AMX_ROWS(item / blocks, blocks - 1 - item % blocks);
        }
#undef AMX_ROWS
        _tile_release();
    }
    free(kp), free(vp), free(qp);
    return 0;
}
#endif
#endif

#ifndef QVL_AMX_ATTENTION /* no AMX-BF16 tiles in this build: the callers take their other paths */
int qvl_amx_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t T, int64_t S,
                      int64_t H, int64_t Hkv, int64_t D, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                      int64_t v_tok, int64_t v_head, int64_t o_tok, int64_t o_head, int64_t causal,
                      const int64_t* kv_blocks, int64_t block, int64_t block_stride, int threads) {
    (void)q, (void)k, (void)v, (void)out, (void)T, (void)S, (void)H, (void)Hkv, (void)D, (void)q_tok, (void)q_head;
    (void)k_tok, (void)k_head, (void)v_tok, (void)v_head, (void)o_tok, (void)o_head, (void)causal, (void)kv_blocks;
    (void)block, (void)block_stride, (void)threads;
    return -2;
}
#endif
