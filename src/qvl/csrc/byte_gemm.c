/* Many-row products with int8 weights, the activations in 8-bit codes per group of columns
 * (qvl_q8_linear): prefill and the vision tower with AVX-512 VNNI, AVX2 (with or without
 * AVX-VNNI) and ARM dot products (smmla with i8mm). */
#include "prefill_gemm.h"
#include "quantise.h"

#if defined(QVL_AVX512) || defined(QVL_AVX2) || (defined(QVL_NEON) && defined(__ARM_FEATURE_DOTPROD))
/* ---- 8-bit activation codes per group of columns (VNNI, NEON dot products) ---------------
 * Each row of x is split into groups of `group` columns, each quantised symmetrically to int8
 * codes (step max|group| / 127: outlier channels coarsen only their own group). vpdpbusd takes
 * unsigned bytes times signed ones, so the weight panel holds w + 128 (1..255) and the codes
 * stay signed: a group's int32 sum starts at -128 * (the sum of its codes), which leaves the
 * exact sum of w . q (|sum| <= 128 * 255 * 127 < 2^31). Each group's sum is multiplied by its
 * step and added in float32 in a fixed order, so a row's result again depends neither on the
 * other rows nor on the thread count. vpdpbusd multiplies four byte pairs per 32-bit lane:
 * twice vpdpwssd's products per instruction.
 *
 * Blocking: the threads take the output columns 32 at a time (take_item) over the whole of K:
 * the tile's weights (K * 32 bytes, w + 128 as quads) are laid out once and stay in L2 while
 * every block of 6 rows runs over them, the block's float totals in registers from the first
 * group to the last, its results written out (with the fused GELU and residual) at once.
 * Unlike the pair kernel's panels, no float partial sums go through memory: for 1008 rows they
 * were 1 MB per thread, past L2, and with two threads 0.87-0.9x of the time went with them.
 *
 * Plain AVX2 (no VNNI) multiplies the same bytes with vpmaddubsw, whose pairs of products are
 * summed in 16 bits with saturation: (w + 128) . q over a pair stays below 2^15 only for codes
 * |q| <= 63 (2 * 255 * 63 = 32130), so there the codes are 7-bit (step max|group| / 63); then
 * vpmaddwd by ones widens the pair sums to int32, still exact. Three instructions per 32
 * multiply-adds against the 16-bit pair kernel's two per 16; on cores that run vpmaddwd and
 * vpmaddubsw on two ports and vpaddd on three (Intel's), 1.15-1.37x its products per call
 * (docs/decisions/prefill-products.md). */
#if (defined(QVL_AVX512) && defined(__AVX512VNNI__)) || defined(QVL_AVX2) || defined(QVL_NEON)
#define QVL_Q8 1
#if defined(QVL_AVX2) && !defined(__AVXVNNI__)
#define Q8_LEVELS 63 /* vpmaddubsw: 7-bit codes */
#else
#define Q8_LEVELS 127
#endif
#define Q4_LEVELS 127 /* int4 weights' codes on every build: nibbles . codes never saturate vpmaddubsw's pairs */

#define Q8_MR 6   /* rows per register block: 2 x 6 int32 sums and 2 x 6 float32 totals */
#if defined(QVL_NEON) && defined(__ARM_FEATURE_MATMUL_INT8)
#define Q8_UNIT 8 /* codes of a row per step: smmla (i8mm) takes 8 (rows in pairs), the dot products 4 */
#else
#define Q8_UNIT 4
#endif
#define Q8_ROWS I16_ROWS_6

#if defined(QVL_AVX512)
static inline vint vi_dp8(vint acc, vint w, vint a) { /* acc += per lane: 4 bytes w (unsigned) . a (signed) */
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
    return acc;
}
#elif defined(QVL_AVX2) && defined(__AVXVNNI__)
static inline vint vi_dp8(vint acc, vint w, vint a) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(a));
    return acc;
}
#elif defined(QVL_AVX2)
static const int16_t q8_ones[16] __attribute__((aligned(32))) = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
/* vpmaddubsw (pairs of w . a in int16: exact for 7-bit codes), vpmaddwd by ones from memory (the
 * register block uses all 16 ymm registers), vpaddd */
static inline vint vi_dp8(vint acc, vint w, vint a) {
    vint t;
    __asm__("vpmaddubsw %3, %2, %1\n\tvpmaddwd %4, %1, %1\n\tvpaddd %1, %0, %0"
            : "+x"(acc), "=&x"(t) : "x"(w), "x"(a), "m"(*(const __m256i*)q8_ones));
    return acc;
}
#endif

/* A row block's and a column tile's int4 factors for the tiles (NULL for int8 weights): each
 * activation group's column scales ws [groups][I16_NR]; each weight group's lowest values
 * lo = zero - 8 * scale [wg][I16_NR] and the rows' coded-activation sums xs [wg][Q8_MR], whose
 * products (the zeros' part) the totals start from. */
typedef struct {
    const float* ws;
    const float* lo;
    const float* xs;
    int64_t wg;
} Q4Factors;

/* Row r's int8 codes[K] into its block's layout a (K * Q8_MR bytes): quads a[K/4][Q8_MR] (quad p
 * of row r at a[p * Q8_MR + r]) for the dot products; for smmla octets in row pairs, [K/8][Q8_MR/2]
 * of 16 bytes (row 2j's 8 codes, then row 2j + 1's). */
static inline void place_codes(int32_t* a, const int8_t* codes, int64_t K, int r) {
#if Q8_UNIT == 8
    for (int64_t o = 0; o < K / 8; o++) memcpy((int8_t*)a + o * 8 * Q8_MR + (r / 2) * 16 + (r % 2) * 8, codes + 8 * o, 8);
#else
    for (int64_t p = 0; p < K / 4; p++) memcpy(a + p * Q8_MR + r, codes + 4 * p, 4); /* one quad */
#endif
}

/* Rows m0..m0+Q8_MR-1 of x (dt [M][K], K % Q8_UNIT == 0; rows past M zero), layer-normalised
 * first when nw (float32 [K], with nb) is given -> codes up to +-levels in a (place_codes), each
 * group's step sg[G][Q8_MR] and -128 * its codes' sum nq[G][Q8_MR], G = ceil(K / group). */
static void pack_groups(const void* x, int dt, int64_t M, int64_t K, int64_t group, float levels, const float* nw,
                        const float* nb, float eps, int64_t m0, int32_t* a, float* sg, int32_t* nq, float* buf,
                        int8_t* codes) {
    const int64_t G = (K + group - 1) / group;
    for (int r = 0; r < Q8_MR; r++) {
        const float* row = buf;
        int finite = 1;
        if (m0 + r < M) {
            row = row_f32(x, dt, K, m0 + r, buf, &finite);
            if (nw) { /* layer-normalised first, as the model's module would (rounded to dt) */
                if (row != buf) memcpy(buf, row, (size_t)K * sizeof(float));
                qvl_layer_norm_row(buf, K, nw, nb, eps, dt);
                row = buf, finite = all_finite(buf, K);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            const int64_t k0 = g * group, n = K - k0 < group ? K - k0 : group;
            const float top = m0 + r < M && finite ? absmax(row + k0, n) : 0.f; /* rows past M: no codes */
            int32_t sum;
            sg[g * Q8_MR + r] = group_codes8(row + k0, n, finite, top, levels, codes + k0, &sum);
            nq[g * Q8_MR + r] = -128 * sum;
        }
        place_codes(a, codes, K, r);
    }
}

#if defined(QVL_AVX512) || defined(QVL_AVX2)
/* The register block, per row r: group sums c (first vector of columns) and d (second) in
 * int32, totals e and f in float32; a group's sums start at its nq and end scaled into e, f. */
#define Q8_DECL2(r) vint c##r, d##r; vflt e##r = vf_set1(0.f), f##r = e##r;
#define Q8_DECL1(r) vint c##r; vflt e##r = vf_set1(0.f);
#define Q8_START2(r) c##r = vi_set1(nq[g * Q8_MR + (r)]), d##r = c##r;
#define Q8_START1(r) c##r = vi_set1(nq[g * Q8_MR + (r)]);
#define Q8_STEP2(r)                                               \
    {                                                             \
        const vint av = vi_set1(a[p * Q8_MR + (r)]);              \
        c##r = vi_dp8(c##r, b0, av), d##r = vi_dp8(d##r, b1, av); \
    }
#define Q8_STEP1(r) c##r = vi_dp8(c##r, b0, vi_set1(a[p * Q8_MR + (r)]));
#define Q8_SCALE2(r)                                  \
    {                                                 \
        const vflt sv = vf_set1(sg[g * Q8_MR + (r)]); \
        e##r = vf_fmadd(vf_of(c##r), sv, e##r);       \
        f##r = vf_fmadd(vf_of(d##r), sv, f##r);       \
    }
#define Q8_SCALE1(r) e##r = vf_fmadd(vf_of(c##r), vf_set1(sg[g * Q8_MR + (r)]), e##r);
/* int4 weights: a group's step times each column's weight scale (w0, w1: ws's group row) */
#define Q4_SCALE2(r)                                                  \
    {                                                                 \
        const vflt sv = vf_set1(sg[g * Q8_MR + (r)]);                 \
        e##r = vf_fmadd(vf_of(c##r), vf_mul(sv, w0), e##r);           \
        f##r = vf_fmadd(vf_of(d##r), vf_mul(sv, w1), f##r);           \
    }
#define Q4_SCALE1(r) e##r = vf_fmadd(vf_of(c##r), vf_mul(vf_set1(sg[g * Q8_MR + (r)]), w0), e##r);
#define Q4_ZERO2(r)                                                \
    {                                                              \
        const vflt xv = vf_set1(q4->xs[g * Q8_MR + (r)]);          \
        e##r = vf_fmadd(xv, l0, e##r), f##r = vf_fmadd(xv, l1, f##r); \
    }
#define Q4_ZERO1(r) e##r = vf_fmadd(vf_set1(q4->xs[g * Q8_MR + (r)]), l0, e##r);
#define Q8_OUT(acc, r, off) vf_store(c + (r) * I16_NR + (off), acc);
#define Q8_OUT2(r) Q8_OUT(e##r, r, 0) Q8_OUT(f##r, r, VL)
#define Q8_OUT1(r) Q8_OUT(e##r, r, 0)

/* c[r][0 .. 2 VL) = the sum over groups of gq quads of each group's exact sum of
 * a [quads][Q8_MR] . b [quads][I16_NR] times its step (sg, nq: [groups][Q8_MR]); c is
 * [Q8_MR][I16_NR]. int4 weights (q4 given): each group's sum times its step and the columns'
 * weight scales, the totals starting from the zeros' part. */
static void q8_tile2(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, const Q4Factors* q4, float* c) {
    Q8_ROWS(Q8_DECL2)
    for (int64_t g = 0; q4 && g < q4->wg; g++) {
        const vflt l0 = vf_load(q4->lo + g * I16_NR), l1 = vf_load(q4->lo + g * I16_NR + VL);
        Q8_ROWS(Q4_ZERO2)
    }
    for (int64_t g = 0, q0 = 0; q0 < quads; g++, q0 += gq) {
        Q8_ROWS(Q8_START2)
        for (int64_t p = q0; p < q0 + gq && p < quads; p++) {
            const vint b0 = vi_load(b + p * I16_NR), b1 = vi_load(b + p * I16_NR + VL);
            Q8_ROWS(Q8_STEP2)
        }
        if (q4) {
            const vflt w0 = vf_load(q4->ws + g * I16_NR), w1 = vf_load(q4->ws + g * I16_NR + VL);
            Q8_ROWS(Q4_SCALE2)
        } else {
            Q8_ROWS(Q8_SCALE2)
        }
    }
    Q8_ROWS(Q8_OUT2)
}

/* The same for the first VL columns only (a block of columns' tail). */
static void q8_tile1(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, const Q4Factors* q4, float* c) {
    Q8_ROWS(Q8_DECL1)
    for (int64_t g = 0; q4 && g < q4->wg; g++) {
        const vflt l0 = vf_load(q4->lo + g * I16_NR);
        Q8_ROWS(Q4_ZERO1)
    }
    for (int64_t g = 0, q0 = 0; q0 < quads; g++, q0 += gq) {
        Q8_ROWS(Q8_START1)
        for (int64_t p = q0; p < q0 + gq && p < quads; p++) {
            const vint b0 = vi_load(b + p * I16_NR);
            Q8_ROWS(Q8_STEP1)
        }
        if (q4) {
            const vflt w0 = vf_load(q4->ws + g * I16_NR);
            Q8_ROWS(Q4_SCALE1)
        } else {
            Q8_ROWS(Q8_SCALE1)
        }
    }
    Q8_ROWS(Q8_OUT1)
}

/* The tile's weights: w rows n0..n0+nr-1 as quads b[K/4][I16_NR] (w + 128: vpdpbusd's unsigned operand). */
static inline void q8_panel(const int8_t* w, int64_t K, int64_t n0, int64_t nr, int32_t* b) {
    weight_panel(w, K, n0, nr, 0, K, PANEL_BYTES, b);
}

/* int4: rows n0..n0+nr-1 of the nibbles w [N][K/2] as quads b[K/4][I16_NR] of bytes 0..15,
 * unpacked as the panel is laid out (unpacked: not used on x86). */
#define Q4_UNPACKED_BYTES(K) 0
static inline void q4_panel(const uint8_t* w, int64_t K, int64_t n0, int64_t nr, int8_t* unpacked, int32_t* b) {
    (void)unpacked;
    weight_panel((const int8_t*)w, K, n0, nr, 0, K, PANEL_NIBBLES, b);
}
#else
/* NEON: sdot multiplies signed bytes by signed bytes, so the weights stay as they are (nq, the
 * x86 kernels' offset, is not used) and each group's int32 sum is the exact sum of w . q
 * (|sum| <= 256 * 128 * 127 < 2^31 at groups of up to 256). The register block: 6 rows x 8
 * columns (two int32x4 of sums and two float32x4 of totals per row), each row's quad of
 * codes taken by lane from one 16-byte (rows 0-3) or 8-byte (rows 4-5) load: 12 sdot per 4
 * loads. The same integer sums and the same float32 operations in the same order as on x86:
 * the same product bits (the fused layer norm's sums and GELU follow each build's vectors). */

#if Q8_UNIT == 8
/* With i8mm, smmla multiplies a 2 x 8 block of codes (two rows) by an 8 x 2 block of weights (two
 * columns) into a 2 x 2 block of int32 sums: 32 multiply-adds per instruction, twice sdot's. The
 * register block stays 6 rows x 8 columns: 3 row pairs x 4 column pairs of 2 x 2 sums and as
 * many float32 totals, 3 + 4 loads per 12 smmla per 8 codes. A group's sums are scaled per row
 * (the step vector [s_r, s_r, s_r+1, s_r+1]) and added in one fmla: per output element the
 * same integer sum and float operation as the dot-product kernels, the same product bits. */

/* The tile's weights: w rows n0..n0+nr-1 as octets b[K/8][I16_NR][8 bytes] (columns past nr zero). */
static inline void q8_panel(const int8_t* w, int64_t K, int64_t n0, int64_t nr, int32_t* b) {
    int8_t* bb = (int8_t*)b;
    for (int64_t o = 0; o < K / 8; o++)
        for (int64_t i = 0; i < I16_NR; i++) {
            if (i < nr)
                memcpy(bb + (o * I16_NR + i) * 8, w + (n0 + i) * K + 8 * o, 8);
            else
                memset(bb + (o * I16_NR + i) * 8, 0, 8);
        }
}

#define Q8M_BLOCKS2(X) X(0, 0) X(0, 1) X(0, 2) X(0, 3) X(1, 0) X(1, 1) X(1, 2) X(1, 3) X(2, 0) X(2, 1) X(2, 2) X(2, 3)
#define Q8M_BLOCKS1(X) X(0, 0) X(0, 1) X(1, 0) X(1, 1) X(2, 0) X(2, 1)
#define Q8M_DECL(p, q) int32x4_t c##p##q; float32x4_t e##p##q = vdupq_n_f32(0.f);
#define Q8M_ZERO(p, q) c##p##q = vdupq_n_s32(0);
#define Q8M_STEP(p, q) c##p##q = vmmlaq_s32(c##p##q, a##p, b##q);
#define Q8M_SCALE(p, q) e##p##q = vfmaq_f32(e##p##q, vcvtq_f32_s32(c##p##q), s##p);
/* int4 weights: the rows' steps times the column pair's weight scales [w_2q, w_2q+1, w_2q, w_2q+1] */
#define Q4M_SCALE(p, q) \
    e##p##q = vfmaq_f32(e##p##q, vcvtq_f32_s32(c##p##q), vmulq_f32(s##p, column_pair(q4->ws + g * I16_NR + 2 * (q))));
#define Q4M_ZERO(p, q)                                                                                       \
    e##p##q = vfmaq_f32(e##p##q, vcombine_f32(vdup_n_f32(q4->xs[g * Q8_MR + 2 * (p)]),                       \
                                              vdup_n_f32(q4->xs[g * Q8_MR + 2 * (p) + 1])),                  \
                        column_pair(q4->lo + g * I16_NR + 2 * (q)));
#define Q8M_OUT(p, q)                                                     \
    vst1_f32(c + (2 * (p)) * I16_NR + 2 * (q), vget_low_f32(e##p##q));     \
    vst1_f32(c + (2 * (p) + 1) * I16_NR + 2 * (q), vget_high_f32(e##p##q));
#define Q8M_PAIR_STEPS(g)                                                                                   \
    const float32x4_t s0 = vcombine_f32(vdup_n_f32(sg[(g) * Q8_MR]), vdup_n_f32(sg[(g) * Q8_MR + 1]));     \
    const float32x4_t s1 = vcombine_f32(vdup_n_f32(sg[(g) * Q8_MR + 2]), vdup_n_f32(sg[(g) * Q8_MR + 3])); \
    const float32x4_t s2 = vcombine_f32(vdup_n_f32(sg[(g) * Q8_MR + 4]), vdup_n_f32(sg[(g) * Q8_MR + 5]));

static inline float32x4_t column_pair(const float* w) { return vcombine_f32(vld1_f32(w), vld1_f32(w)); }

/* c[r][0 .. 2 VL) = the sum over groups of gq quads (gq / 2 octets) of each group's exact sum of
 * the codes a (place_codes) . the weights b (q8_panel) times its step (sg: [groups][Q8_MR]); c is
 * [Q8_MR][I16_NR]. int4 weights (q4 given): as x86's q8_tile2. */
static void q8_tile2(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, const Q4Factors* q4, float* c) {
    (void)nq;
    const int8_t *ab = (const int8_t*)a, *bb = (const int8_t*)b;
    const int64_t octets = quads / 2, go = gq / 2;
    Q8M_BLOCKS2(Q8M_DECL)
    for (int64_t g = 0; q4 && g < q4->wg; g++) { Q8M_BLOCKS2(Q4M_ZERO) }
    for (int64_t g = 0, o0 = 0; o0 < octets; g++, o0 += go) {
        Q8M_BLOCKS2(Q8M_ZERO)
        for (int64_t o = o0; o < o0 + go && o < octets; o++) {
            const int8x16_t a0 = vld1q_s8(ab + o * 48), a1 = vld1q_s8(ab + o * 48 + 16), a2 = vld1q_s8(ab + o * 48 + 32);
            const int8x16_t b0 = vld1q_s8(bb + o * 64), b1 = vld1q_s8(bb + o * 64 + 16);
            const int8x16_t b2 = vld1q_s8(bb + o * 64 + 32), b3 = vld1q_s8(bb + o * 64 + 48);
            Q8M_BLOCKS2(Q8M_STEP)
        }
        Q8M_PAIR_STEPS(g)
        if (q4) {
            Q8M_BLOCKS2(Q4M_SCALE)
        } else {
            Q8M_BLOCKS2(Q8M_SCALE)
        }
    }
    Q8M_BLOCKS2(Q8M_OUT)
}

/* The same for the first VL columns only (a block of columns' tail). */
static void q8_tile1(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, const Q4Factors* q4, float* c) {
    (void)nq;
    const int8_t *ab = (const int8_t*)a, *bb = (const int8_t*)b;
    const int64_t octets = quads / 2, go = gq / 2;
    Q8M_BLOCKS1(Q8M_DECL)
    for (int64_t g = 0; q4 && g < q4->wg; g++) { Q8M_BLOCKS1(Q4M_ZERO) }
    for (int64_t g = 0, o0 = 0; o0 < octets; g++, o0 += go) {
        Q8M_BLOCKS1(Q8M_ZERO)
        for (int64_t o = o0; o < o0 + go && o < octets; o++) {
            const int8x16_t a0 = vld1q_s8(ab + o * 48), a1 = vld1q_s8(ab + o * 48 + 16), a2 = vld1q_s8(ab + o * 48 + 32);
            const int8x16_t b0 = vld1q_s8(bb + o * 64), b1 = vld1q_s8(bb + o * 64 + 16);
            Q8M_BLOCKS1(Q8M_STEP)
        }
        Q8M_PAIR_STEPS(g)
        if (q4) {
            Q8M_BLOCKS1(Q4M_SCALE)
        } else {
            Q8M_BLOCKS1(Q8M_SCALE)
        }
    }
    Q8M_BLOCKS1(Q8M_OUT)
}
#else
/* The tile's weights: w rows n0..n0+nr-1 as quads b[K/4][I16_NR] (4 bytes of one row each;
 * columns past nr zero). */
static inline void q8_panel(const int8_t* w, int64_t K, int64_t n0, int64_t nr, int32_t* b) {
    for (int64_t p = 0; p < K / 4; p++)
        for (int64_t i = 0; i < I16_NR; i++) {
            int32_t d = 0;
            if (i < nr) memcpy(&d, w + (n0 + i) * K + 4 * p, 4);
            b[p * I16_NR + i] = d;
        }
}

#define Q8_NEON_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define Q8N_DECL2(r) int32x4_t c##r, d##r; float32x4_t e##r = vdupq_n_f32(0.f), f##r = e##r;
#define Q8N_DECL1(r) int32x4_t c##r; float32x4_t e##r = vdupq_n_f32(0.f);
#define Q8N_ZERO2(r) c##r = vdupq_n_s32(0), d##r = c##r;
#define Q8N_ZERO1(r) c##r = vdupq_n_s32(0);
#define Q8N_SCALE2(r)                                       \
    e##r = vfmaq_n_f32(e##r, vcvtq_f32_s32(c##r), sg[g * Q8_MR + (r)]); \
    f##r = vfmaq_n_f32(f##r, vcvtq_f32_s32(d##r), sg[g * Q8_MR + (r)]);
#define Q8N_SCALE1(r) e##r = vfmaq_n_f32(e##r, vcvtq_f32_s32(c##r), sg[g * Q8_MR + (r)]);
#define Q4N_SCALE2(r)                                                                  \
    e##r = vfmaq_f32(e##r, vcvtq_f32_s32(c##r), vmulq_n_f32(w0, sg[g * Q8_MR + (r)])); \
    f##r = vfmaq_f32(f##r, vcvtq_f32_s32(d##r), vmulq_n_f32(w1, sg[g * Q8_MR + (r)]));
#define Q4N_SCALE1(r) e##r = vfmaq_f32(e##r, vcvtq_f32_s32(c##r), vmulq_n_f32(w0, sg[g * Q8_MR + (r)]));
#define Q4N_ZERO2(r)                                      \
    e##r = vfmaq_n_f32(e##r, l0, q4->xs[g * Q8_MR + (r)]); \
    f##r = vfmaq_n_f32(f##r, l1, q4->xs[g * Q8_MR + (r)]);
#define Q4N_ZERO1(r) e##r = vfmaq_n_f32(e##r, l0, q4->xs[g * Q8_MR + (r)]);
#define Q8N_OUT2(r) vst1q_f32(c + (r) * I16_NR, e##r), vst1q_f32(c + (r) * I16_NR + VL, f##r);
#define Q8N_OUT1(r) vst1q_f32(c + (r) * I16_NR, e##r);

/* c[r][0 .. 2 VL) = the sum over groups of gq quads of each group's exact sum of
 * a [quads][Q8_MR] . b [quads][I16_NR] times its step (sg: [groups][Q8_MR]); c is
 * [Q8_MR][I16_NR]. */
static void q8_tile2(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, const Q4Factors* q4, float* c) {
    (void)nq;
    Q8_NEON_ROWS(Q8N_DECL2)
    for (int64_t g = 0; q4 && g < q4->wg; g++) {
        const float32x4_t l0 = vld1q_f32(q4->lo + g * I16_NR), l1 = vld1q_f32(q4->lo + g * I16_NR + VL);
        Q8_NEON_ROWS(Q4N_ZERO2)
    }
    for (int64_t g = 0, q0 = 0; q0 < quads; g++, q0 += gq) {
        Q8_NEON_ROWS(Q8N_ZERO2)
        for (int64_t p = q0; p < q0 + gq && p < quads; p++) {
            const int8x16_t b0 = vld1q_s8((const int8_t*)(b + p * I16_NR));
            const int8x16_t b1 = vld1q_s8((const int8_t*)(b + p * I16_NR + VL));
            const int8x16_t lo = vld1q_s8((const int8_t*)(a + p * Q8_MR)); /* rows 0-3 */
            const int8x8_t hi = vld1_s8((const int8_t*)(a + p * Q8_MR + 4)); /* rows 4-5 */
            c0 = vdotq_laneq_s32(c0, b0, lo, 0), d0 = vdotq_laneq_s32(d0, b1, lo, 0);
            c1 = vdotq_laneq_s32(c1, b0, lo, 1), d1 = vdotq_laneq_s32(d1, b1, lo, 1);
            c2 = vdotq_laneq_s32(c2, b0, lo, 2), d2 = vdotq_laneq_s32(d2, b1, lo, 2);
            c3 = vdotq_laneq_s32(c3, b0, lo, 3), d3 = vdotq_laneq_s32(d3, b1, lo, 3);
            c4 = vdotq_lane_s32(c4, b0, hi, 0), d4 = vdotq_lane_s32(d4, b1, hi, 0);
            c5 = vdotq_lane_s32(c5, b0, hi, 1), d5 = vdotq_lane_s32(d5, b1, hi, 1);
        }
        if (q4) {
            const float32x4_t w0 = vld1q_f32(q4->ws + g * I16_NR), w1 = vld1q_f32(q4->ws + g * I16_NR + VL);
            Q8_NEON_ROWS(Q4N_SCALE2)
        } else {
            Q8_NEON_ROWS(Q8N_SCALE2)
        }
    }
    Q8_NEON_ROWS(Q8N_OUT2)
}

/* The same for the first VL columns only (a block of columns' tail). */
static void q8_tile1(const int32_t* a, const int32_t* b, int64_t quads, int64_t gq, const float* sg,
                     const int32_t* nq, const Q4Factors* q4, float* c) {
    (void)nq;
    Q8_NEON_ROWS(Q8N_DECL1)
    for (int64_t g = 0; q4 && g < q4->wg; g++) {
        const float32x4_t l0 = vld1q_f32(q4->lo + g * I16_NR);
        Q8_NEON_ROWS(Q4N_ZERO1)
    }
    for (int64_t g = 0, q0 = 0; q0 < quads; g++, q0 += gq) {
        Q8_NEON_ROWS(Q8N_ZERO1)
        for (int64_t p = q0; p < q0 + gq && p < quads; p++) {
            const int8x16_t b0 = vld1q_s8((const int8_t*)(b + p * I16_NR));
            const int8x16_t lo = vld1q_s8((const int8_t*)(a + p * Q8_MR));
            const int8x8_t hi = vld1_s8((const int8_t*)(a + p * Q8_MR + 4));
            c0 = vdotq_laneq_s32(c0, b0, lo, 0), c1 = vdotq_laneq_s32(c1, b0, lo, 1);
            c2 = vdotq_laneq_s32(c2, b0, lo, 2), c3 = vdotq_laneq_s32(c3, b0, lo, 3);
            c4 = vdotq_lane_s32(c4, b0, hi, 0), c5 = vdotq_lane_s32(c5, b0, hi, 1);
        }
        if (q4) {
            const float32x4_t w0 = vld1q_f32(q4->ws + g * I16_NR);
            Q8_NEON_ROWS(Q4N_SCALE1)
        } else {
            Q8_NEON_ROWS(Q8N_SCALE1)
        }
    }
    Q8_NEON_ROWS(Q8N_OUT1)
}
#endif /* i8mm or dot products */

/* int4: rows n0..n0+nr-1 of the nibbles w [N][K/2] in q8_panel's layout, as bytes 0..15 (first
 * unpacked into `unpacked`, [nr][K] bytes). */
#define Q4_UNPACKED_BYTES(K) ((K) * I16_NR)
static void q4_panel(const uint8_t* w, int64_t K, int64_t n0, int64_t nr, int8_t* unpacked, int32_t* b) {
    for (int64_t i = 0; i < nr; i++) {
        const uint8_t* src = w + (n0 + i) * (K / 2);
        int8_t* dst = unpacked + i * K;
#pragma omp simd
        for (int64_t j = 0; j < K / 2; j++)
            dst[2 * j] = (int8_t)(src[j] & 15), dst[2 * j + 1] = (int8_t)(src[j] >> 4);
    }
    q8_panel(unpacked, K, 0, nr, b);
}
#endif

/* The weights of a byte-code product: int8 w [N][K] with a scale per row (zero NULL), or int4
 * nibbles [N][K/2] (even column in the low nibble) with a scale and a zero per group of gs
 * inputs ([N][K/gs] each, dt): w = (q - 8) * scale + zero. */
typedef struct {
    const void* w;
    const void* scale;
    const void* zero;
    int64_t gs;
} ByteWeights;

/* int4 weights, per row block: each weight group's sum of the coded activations, xs[g][r] =
 * sum over its activation groups h of sg[h][r] * (the codes' sum: nq[h][r] / -128), for the
 * zeros' part of the product (G, H: weight and activation groups); nq then zero (the panel
 * holds the nibbles as they are: no offset to take back). */
static void coded_sums(float* xs, const float* sg, int32_t* nq, int64_t G, int64_t H) {
    for (int r = 0; r < Q8_MR; r++)
        for (int64_t g = 0; g < G; g++) {
            float v = 0.f;
            for (int64_t h = g * (H / G); h < (g + 1) * (H / G); h++)
                v += sg[h * Q8_MR + r] * (float)(nq[h * Q8_MR + r] / -128);
            xs[g * Q8_MR + r] = v;
        }
    memset(nq, 0, (size_t)(H * Q8_MR) * sizeof(int32_t));
}

/* int4 weights: the tile's columns n0..n0+nr-1's factors in float32 (columns past nr zero):
 * each activation group's weight scale ws [K/group][I16_NR], each weight group's lowest value
 * lo = zero - 8 * scale [K/gs][I16_NR]. */
static void q4_factors(const ByteWeights* wt, int dt, int64_t K, int64_t n0, int64_t nr, int64_t group, float* ws,
                       float* lo) {
    const int64_t G = K / wt->gs, per = wt->gs / group; /* weight groups; activation groups in each */
    memset(ws, 0, (size_t)(G * per * I16_NR) * sizeof(float));
    memset(lo, 0, (size_t)(G * I16_NR) * sizeof(float));
    for (int64_t i = 0; i < nr; i++) {
        const int64_t at = (n0 + i) * G; /* the column's groups */
        float s[G], z[G];
        if (dt == BF16) {
            const uint16_t *sb = (const uint16_t*)wt->scale + at, *zb = (const uint16_t*)wt->zero + at;
#pragma omp simd
            for (int64_t g = 0; g < G; g++) s[g] = bf16_to_f32(sb[g]), z[g] = bf16_to_f32(zb[g]);
        } else {
            memcpy(s, (const float*)wt->scale + at, sizeof s), memcpy(z, (const float*)wt->zero + at, sizeof z);
        }
        for (int64_t g = 0; g < G; g++) {
            lo[g * I16_NR + i] = z[g] - 8.f * s[g];
            for (int64_t h = g * per; h < (g + 1) * per; h++) ws[h * I16_NR + i] = s[g];
        }
    }
}

/* y [M][N] (dt) = x [M][K] (dt) . W^T (+ bias[N] (dt)), x in 8-bit codes per `group` columns
 * (Q8_LEVELS; Q4_LEVELS for int4 weights), W the int8 or int4 weights `wt` (ByteWeights). Fusions
 * and return values as qvl_q8_linear's. */
static int byte_products(const void* x, int dt, int64_t M, int64_t K, int64_t N, const ByteWeights* wt,
                         const void* bias, void* y, int threads, int group, const void* norm_w, const void* norm_b,
                         float eps, int gelu, const void* residual) {
    const int int4 = wt->zero != NULL;
    if (K % Q8_UNIT || N % VL || M < 1 || K < 4 || group < Q8_UNIT || group % Q8_UNIT || group > 256) return -2;
    if (int4 && (wt->gs % group || K % wt->gs)) return -2;
    const int64_t MB = (M + Q8_MR - 1) / Q8_MR, Q = K / 4, G = (K + group - 1) / group, T = threads < 1 ? 1 : threads;
    const int64_t GW = int4 ? K / wt->gs : 0; /* int4: weight groups */
    int32_t* a = aligned_alloc(64, (size_t)(MB * Q * Q8_MR * 4 + 63) / 64 * 64);
    float* sg = malloc((size_t)(MB * G * Q8_MR) * sizeof(float));
    int32_t* nq = malloc((size_t)(MB * G * Q8_MR) * sizeof(int32_t));
    float* xs = malloc((size_t)(MB * GW * Q8_MR + 1) * sizeof(float));
    float *nw = NULL, *nb = NULL, *cs = NULL, *cb = NULL; /* the norm's and the columns' factors in float32 */
    if (!a || !sg || !nq || !xs || (norm_w && qvl_rescale_columns(norm_w, norm_b, dt, K, &nw, &nb)) ||
        qvl_rescale_columns(int4 ? NULL : wt->scale, bias, dt, N, &cs, &cb)) {
        free(a), free(sg), free(nq), free(xs), free(nw);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(T)
    {
        float* buf = malloc((size_t)K * sizeof(float));
        int8_t* codes = malloc((size_t)K);
        if (!buf || !codes) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4) /* blocks of rows in turn, as take_item */
        for (int64_t mb = 0; mb < MB; mb++)
            if (buf && codes) {
                pack_groups(x, dt, M, K, group, int4 ? Q4_LEVELS : Q8_LEVELS, nw, nb, eps, mb * Q8_MR,
                            a + mb * Q * Q8_MR, sg + mb * G * Q8_MR, nq + mb * G * Q8_MR, buf, codes);
                if (int4) coded_sums(xs + mb * GW * Q8_MR, sg + mb * G * Q8_MR, nq + mb * G * Q8_MR, GW, G);
            }
        free(buf), free(codes);
    }
    if (failed) {
        free(a), free(sg), free(nq), free(xs), free(nw), free(cs);
        return -1;
    }
    const int64_t gq = group / 4, tiles = (N + I16_NR - 1) / I16_NR, chunk = chunk_blocks(K * Q8_MR);
    const int64_t items = (MB + chunk - 1) / chunk * tiles;
    int64_t next = 0;
#pragma omp parallel num_threads(T)
    {
        /* one column tile at a time over the whole of K: its weights (K * 32 bytes) stay in L2
         * while the row blocks of a chunk (their codes too: ROW_CHUNK bytes) run over them, each
         * block's float totals in registers from the first group to the last, its 6 x 32
         * results written out at once; (chunk, tile) pairs taken in turn (take_item), each
         * tile's weights laid out again per chunk (a few % of the products' time, against the
         * codes of every row streaming from memory per tile). int4: the nibbles unpacked as the
         * tile's weights are laid out, with its columns' scales and zeros */
        int32_t* b = aligned_alloc(64, (size_t)(Q * I16_NR * 4 + 63) / 64 * 64);
        float* ws = int4 ? malloc((size_t)((G + GW) * I16_NR) * sizeof(float) + Q4_UNPACKED_BYTES(K)) : NULL;
        float* lo = ws ? ws + G * I16_NR : NULL; /* q4_factors' */
        int8_t* unpacked = ws ? (int8_t*)(lo + GW * I16_NR) : NULL;
        const int ready = b && (!int4 || ws);
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t item; ready && (item = take_item(&next, items)) >= 0;) {
            const int64_t mb0 = item / tiles * chunk, n0 = item % tiles * I16_NR;
            const int64_t nr = N - n0 < I16_NR ? N - n0 : I16_NR;
            float c[Q8_MR * I16_NR];
            if (int4) {
                q4_panel(wt->w, K, n0, nr, unpacked, b);
                q4_factors(wt, dt, K, n0, nr, group, ws, lo);
            } else {
                q8_panel(wt->w, K, n0, nr, b);
            }
            for (int64_t mb = mb0; mb < MB && mb < mb0 + chunk; mb++) {
                const int64_t m0 = mb * Q8_MR, rows = M - m0 < Q8_MR ? M - m0 : Q8_MR;
                const int32_t* am = a + mb * Q * Q8_MR;
                const Q4Factors f = {ws, lo, xs + mb * GW * Q8_MR, GW}, *q4 = int4 ? &f : NULL;
                if (nr == I16_NR)
                    q8_tile2(am, b, Q, gq, sg + mb * G * Q8_MR, nq + mb * G * Q8_MR, q4, c);
                else
                    q8_tile1(am, b, Q, gq, sg + mb * G * Q8_MR, nq + mb * G * Q8_MR, q4, c);
                write_rows(c, I16_NR, NULL, rows, n0, nr, cs + n0, cb + n0, dt, N, gelu, /* steps in c */
                           residual ? (const char*)residual + m0 * N * (dt == BF16 ? 2 : 4) : NULL,
                           (char*)y + m0 * N * (dt == BF16 ? 2 : 4));
            }
        }
        free(b), free(ws);
    }
    free(a), free(sg), free(nq), free(xs), free(nw), free(cs);
    return failed ? -1 : 0;
}

/* y [M][N] (dt) = x [M][K] (dt) . (w [N][K] int8 * scale[N] (dt))^T (+ bias[N] (dt)), x in
 * 8-bit codes per `group` columns. Fused around it, as the vision tower's layers ask: with
 * norm_w (dt [K], and norm_b or NULL) x's rows are layer-normalised first (never written);
 * `gelu` applies tanh-GELU to the result and `residual` ([M][N] dt, or NULL) is added to it
 * (write_rows). Returns 0, -1 when out of memory, -2 for shapes it does not take (K or the
 * group size not a multiple of Q8_UNIT, a group past 256, N % VL). */
int qvl_q8_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const int8_t* w, const void* scale,
                  const void* bias, void* y, int threads, int group, const void* norm_w, const void* norm_b, float eps,
                  int gelu, const void* residual) {
    const ByteWeights wt = {w, scale, NULL, 0};
    return byte_products(x, dt, M, K, N, &wt, bias, y, threads, group, norm_w, norm_b, eps, gelu, residual);
}

/* y [M][N] (dt) = x [M][K] (dt) . W^T (+ bias[N] (dt)), W int4: nibbles w [N][K/2] (even column
 * in the low nibble), scale and zero [N][K/gs] (dt), W = (q - 8) * scale + zero; x in 8-bit codes
 * (127 levels on every build) per `group` columns. Each activation group's exact sum of codes .
 * nibbles is scaled by its step times the column's group scale; the zeros' part is each weight
 * group's coded-activation sum times its lowest value zero - 8 * scale: the product of the coded
 * activations with W. Returns as qvl_q8_linear, -2 also when gs is not a multiple of the group
 * or does not divide K. */
int qvl_q4_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const uint8_t* w, const void* scale,
                  const void* zero, int64_t gs, const void* bias, void* y, int threads, int group) {
    if (!zero || gs < 1) return -2;
    const ByteWeights wt = {w, scale, zero, gs};
    return byte_products(x, dt, M, K, N, &wt, bias, y, threads, group, NULL, NULL, 0.f, 0, NULL);
}

int qvl_q8_levels(void) { return Q8_LEVELS; }
#endif /* byte products */

#endif

#ifndef QVL_Q8 /* no byte products: prefill keeps 16-bit codes */
int qvl_q8_levels(void) { return 0; }
int qvl_q4_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const uint8_t* w, const void* scale,
                  const void* zero, int64_t gs, const void* bias, void* y, int threads, int group) {
    (void)x, (void)dt, (void)M, (void)K, (void)N, (void)w, (void)scale, (void)zero, (void)gs, (void)bias, (void)y;
    (void)threads, (void)group;
    return -2;
}
int qvl_q8_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const int8_t* w, const void* scale,
                  const void* bias, void* y, int threads, int group, const void* norm_w, const void* norm_b, float eps,
                  int gelu, const void* residual) {
    (void)x, (void)dt, (void)M, (void)K, (void)N, (void)w, (void)scale, (void)bias, (void)y, (void)threads, (void)group;
    (void)norm_w, (void)norm_b, (void)eps, (void)gelu, (void)residual;
    return -2;
}
#endif
