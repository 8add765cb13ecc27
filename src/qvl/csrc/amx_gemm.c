/* int8 weights . 16-bit activations on AMX tiles (Sapphire Rapids and later): the products of
 * 1-64 activation rows (decoding: the plan's AMX_GEMV_MAX_ROWS, qvl/kernels/plan.py), with
 * the same exact integer sums per 128-column chunk as gemv.c's VNNI kernel, for 16 weight rows
 * per tile operation instead of one.
 *
 * AMX multiplies bytes, so each 16-bit code q is split into q = 256 * hi + lo (hi signed,
 * lo unsigned) and a chunk's sum is 256 * (w . hi) + (w . lo): TDPBSSD and TDPBSUD with the
 * weights as the A tile (16 weight rows x 64 columns, read in place from the [N][K] layout)
 * and the activations as B tiles (prepared once per call). Each output is then accumulated
 * in float32 chunk by chunk, in the same order whatever the number of rows, so a row's result
 * never depends on the others.
 *
 * Also here: qvl_amx_bf16_linear, prefill's many-row int8/int4 products on AMX-BF16 tiles (see
 * its comment below). */
#include "common.h"
#include "amx_tiles.h"

#if defined(QVL_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_granted;

/* Linux hands a process the tiles' register state only when it asks for it. */
__attribute__((constructor)) static void amx_request(void) {
    amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int qvl_int8_amx_ready(void) { return amx_granted; }

/* The eight tile registers (literal numbers: the intrinsics paste them into the instruction). */
#define T_HI_SUM 0
#define T_LO_SUM 1
#define T_W0 2
#define T_W1 3
#define T_HI0 4
#define T_LO0 5
#define T_HI1 6
#define T_LO1 7

static inline __m512i lanes_times(int step) { /* lane i holds i * step */
    return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32(step));
}

static void configure(int mt) { /* weights: 16 rows x 64 bytes; activations and sums: mt columns */
    TileConfig cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = (t == T_W0 || t == T_W1) ? 64 : (uint16_t)(mt * 4);
    }
    _tile_loadconfig(&cfg);
}

/* The B tiles of activation rows m0..m0+mt-1 (from their 16-bit codes q [M][K]): for each
 * 64-column half g of K, 16 tile rows (4 columns each) of mt rows x 4 bytes, the high bytes in
 * hi, the low bytes in lo; and each chunk's activation scales laid out as the [16][mt] sums
 * (rep [K/CHUNK][16 * mt]). */
static void split_codes(const int16_t* q, const float* xs, int64_t m0, int mt, int64_t K, int8_t* hi, uint8_t* lo,
                        float* rep) {
    const int64_t C = K / CHUNK;
    /* per 64 columns of a row: its 16 runs of 4 bytes go to tile rows 0..15, mt * 4 bytes apart */
    const __m512i runs = lanes_times(mt);
    for (int m = 0; m < mt; m++)
        for (int64_t g = 0; g < K / 64; g++) {
            const int16_t* v = q + (m0 + m) * K + g * 64;
            const __m512i a = _mm512_loadu_si512(v), b = _mm512_loadu_si512(v + 32);
            const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(a, 8))),
                                                 _mm512_cvtepi16_epi8(_mm512_srai_epi16(b, 8)), 1);
            const __m512i l = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)),
                                                 _mm512_cvtepi16_epi8(b), 1); /* truncation keeps the low byte */
            const int64_t at = g * 16 * mt * 4 + m * 4;
            _mm512_i32scatter_epi32(hi + at, runs, h, 4);
            _mm512_i32scatter_epi32(lo + at, runs, l, 4);
        }
    for (int64_t c = 0; c < C; c++)
        for (int i = 0; i < 16 * mt; i++) rep[c * 16 * mt + i] = xs[(m0 + i % mt) * C + c];
}

/* out[n][m] (float32, n in 16 weight rows from w, m < mt) = sum over chunks c of
 * (exact integer chunk sum) * scales[c][m], accumulated in chunk order. */
static void tile_rows(const int8_t* w, int64_t K, const int8_t* hi, const uint8_t* lo, const float* scales, int mt,
                      float* out) {
    const int64_t C = K / CHUNK, stride = mt * 4, half = 16 * stride;
    int32_t hs[256], ls[256];
    __m512 acc[16];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps(); /* 16 * mt sums = mt vectors of 16 */
    for (int64_t c = 0; c < C; c++) {
        _tile_zero(T_HI_SUM);
        _tile_zero(T_LO_SUM);
        _tile_loadd(T_W0, w + c * CHUNK, K);
        _tile_loadd(T_W1, w + c * CHUNK + 64, K);
        _tile_loadd(T_HI0, hi + 2 * c * half, stride);
        _tile_loadd(T_LO0, lo + 2 * c * half, stride);
        _tile_loadd(T_HI1, hi + (2 * c + 1) * half, stride);
        _tile_loadd(T_LO1, lo + (2 * c + 1) * half, stride);
        _tile_dpbssd(T_HI_SUM, T_W0, T_HI0);
        _tile_dpbsud(T_LO_SUM, T_W0, T_LO0);
        _tile_dpbssd(T_HI_SUM, T_W1, T_HI1);
        _tile_dpbsud(T_LO_SUM, T_W1, T_LO1);
        _tile_stored(T_HI_SUM, hs, stride);
        _tile_stored(T_LO_SUM, ls, stride);
        const float* s = scales + c * 16 * mt;
        for (int i = 0; i < mt; i++) {
            __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(hs + 16 * i), 8),
                                           _mm512_loadu_si512(ls + 16 * i));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_loadu_ps(s + 16 * i), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) _mm512_storeu_ps(out + 16 * i, acc[i]);
}

static inline __m512 load16_dt(const void* p, int dt, int64_t i) {
    return dt == BF16 ? bf16x16_to_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i)))
                      : _mm512_loadu_ps((const float*)p + i);
}

/* y[m0 + m][n0 .. n0+15] = out[.][m] * scale (+ bias), for m < mt (out [16][mt], as tile_rows
 * leaves it): a gather per activation row, the same operations whatever mt is. */
static void write_rows(const float* out, int mt, const void* scale, const void* bias, int dt, int64_t n0,
                       int64_t m0, int64_t N, void* y) {
    const __m512 s = load16_dt(scale, dt, n0), b = bias ? load16_dt(bias, dt, n0) : _mm512_setzero_ps();
    const __m512i column = lanes_times(mt);
    for (int m = 0; m < mt; m++) {
        __m512 v = _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(m)), out, 4), s);
        if (bias) v = _mm512_add_ps(v, b);
        if (dt == BF16) {
            float tmp[16];
            _mm512_storeu_ps(tmp, v);
            uint16_t* row = (uint16_t*)y + (m0 + m) * N + n0;
            for (int i = 0; i < 16; i++) row[i] = f32_to_bf16(tmp[i]);
        } else {
            _mm512_storeu_ps((float*)y + (m0 + m) * N + n0, v);
        }
    }
}

/* The decode GEMV's int8 products on AMX tiles, for team.h's items: the activation rows' codes
 * split once (qvl_amx_codes), then blocks of 16 weight rows, each thread's tiles configured for
 * the row count it last used (qvl_amx_block), the results written (qvl_amx_write) by whichever
 * thread commits the block; qvl_thread_done releases a thread's tiles at the end of its region. */
static __thread int amx_rows; /* the activation rows this thread's tiles are configured for (0: none) */

int64_t qvl_amx_codes_bytes(int64_t M, int64_t K) {
    if (!amx_granted || K % CHUNK) return 0;
    return 2 * M * K + (M + 15) / 16 * (K / CHUNK) * 256 * (int64_t)sizeof(float) + 128;
}

void qvl_amx_codes(const int16_t* q, const float* xs, int64_t M, int64_t K, char* mem, AmxCodes* a) {
    const int64_t C = K / CHUNK, MB = (M + 15) / 16;
    a->M = M, a->K = K;
    a->rep = (float*)mem;
    a->hi = (int8_t*)(a->rep + MB * C * 256);
    a->lo = (uint8_t*)(a->hi + M * K);
    for (int64_t mb = 0; mb < MB; mb++) {
        const int mt = M - mb * 16 < 16 ? (int)(M - mb * 16) : 16;
        split_codes(q, xs, mb * 16, mt, K, a->hi + mb * 16 * K, a->lo + mb * 16 * K, a->rep + mb * C * 256);
    }
}

/* own[mb * 256 ..] = the [16][mt] float32 sums of weight rows 16b..16b+15 (w [N][K]) and
 * activation rows 16mb.., for every block mb of 16 activation rows. */
void qvl_amx_block(const AmxCodes* a, const int8_t* w, int64_t b, float* own) {
    const int64_t M = a->M, K = a->K, C = K / CHUNK;
    for (int64_t mb = 0; mb * 16 < M; mb++) {
        const int mt = M - mb * 16 < 16 ? (int)(M - mb * 16) : 16;
        if (mt != amx_rows) configure(mt), amx_rows = mt;
        tile_rows(w + b * 16 * K, K, a->hi + mb * 16 * K, a->lo + mb * 16 * K, a->rep + mb * C * 256, mt,
                  own + mb * 256);
    }
}

/* y[m][16b..16b+15] from qvl_amx_block's sums: times scale (+ bias), in dt (y [M][N]). */
void qvl_amx_write(const AmxCodes* a, const float* own, const void* scale, const void* bias, int dt, int64_t b,
                   int64_t N, void* y) {
    for (int64_t mb = 0; mb * 16 < a->M; mb++) {
        const int mt = a->M - mb * 16 < 16 ? (int)(a->M - mb * 16) : 16;
        write_rows(own + mb * 256, mt, scale, bias, dt, b * 16, mb * 16, N, y);
    }
}

void qvl_thread_done(void) {
    if (amx_rows) _tile_release();
    amx_rows = 0;
}

/* ---- many-row int8 x int8 products (the vision tower, int8-activation prefill) ----
 * u8 activation codes [Mp][Kp] (Mp, Kp multiples of 32 and 64, zero-padded) times the int8
 * weight packed by qvl_amx_pack_int8, exact int32 sums (TDPBUSD), and the rescale of each
 * 32 x 32 block of sums while it is in L1 (qvl_rescale_row, as qvl_rescale does after oneDNN's
 * GEMM: the int32 sums converted to float32 as oneDNN converts them). Tiles: sums 0-3
 * ([m-half][n-half]), activations 4-5, weights 6-7. */
#define I8_PANEL 8 /* 32-column blocks per panel: a thread's weight panel (256 x Kp) stays in L2 */

/* Tiles 0-3 = codes rows m0..m0+31 (a) . weight columns n0..n0+31 (b0, b1; n0..n0+15 when
 * !two); the products are queued, and sums_store waits for them. */
static inline void int8_block(const uint8_t* a, int64_t Kp, const int8_t* b0, const int8_t* b1, int two) {
    const int64_t KC = Kp / 64;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < KC; kc++) {
        _tile_loadd(4, a + kc * 64, Kp);
        _tile_loadd(5, a + 16 * Kp + kc * 64, Kp);
        _tile_loadd(6, b0 + kc * 1024, 64);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(2, 5, 6);
        if (two) {
            _tile_loadd(7, b1 + kc * 1024, 64);
            _tile_dpbusd(1, 4, 7);
            _tile_dpbusd(3, 5, 7);
        }
    }
}

static inline void sums_store(int two, int32_t* sums) { /* [32][32] */
    _tile_stored(0, sums, 128);
    _tile_stored(2, sums + 16 * 32, 128);
    if (two) {
        _tile_stored(1, sums + 16, 128);
        _tile_stored(3, sums + 16 * 32 + 16, 128);
    }
}

/* The first `rows` rows and `cols` (16 or 32) columns of a block of sums [32][32], rescaled as
 * qvl_rescale_row does into y and with res (row stride N, both dt); rs, lo: the rows' scales,
 * colsum, cs, b: the columns'. bf16 with the column vectors held across the rows. */
static inline void rescale_block(int32_t* sums, int64_t rows, int cols, const float* rs, const float* lo,
                                 const float* colsum, const float* cs, const float* b, int dt, int gelu,
                                 const char* res, char* y, int64_t N, float* tmp) {
#ifdef __AVX512BF16__
    if (dt == BF16) {
        const __m512 c0 = _mm512_loadu_ps(cs), s0 = _mm512_loadu_ps(colsum), b0 = _mm512_loadu_ps(b);
        const __m512 c1 = cols > 16 ? _mm512_loadu_ps(cs + 16) : c0, s1 = cols > 16 ? _mm512_loadu_ps(colsum + 16) : s0;
        const __m512 b1 = cols > 16 ? _mm512_loadu_ps(b + 16) : b0;
        for (int64_t r = 0; r < rows; r++) {
            const __m512 r_s = _mm512_set1_ps(rs[r]), r_lo = _mm512_set1_ps(lo[r]);
            const uint16_t* rr = res ? (const uint16_t*)res + r * N : NULL;
            uint16_t* o = (uint16_t*)y + r * N;
            rescale16_bf16(_mm512_cvtepi32_ps(_mm512_loadu_si512(sums + r * 32)), r_s, r_lo, c0, s0, b0, gelu, rr, o);
            if (cols > 16)
                rescale16_bf16(_mm512_cvtepi32_ps(_mm512_loadu_si512(sums + r * 32 + 16)), r_s, r_lo, c1, s1, b1, gelu,
                               rr ? rr + 16 : NULL, o + 16);
        }
        return;
    }
#endif
    const size_t es = dt == BF16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        float* a = (float*)sums + r * 32;
        for (int c = 0; c < cols; c += 16)
            _mm512_storeu_ps(a + c, _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + r * 32 + c)));
        qvl_rescale_row(a, rs[r], lo[r], colsum, cs, b, dt, cols, gelu, res ? res + r * N * es : NULL,
                        y + r * N * es, tmp);
    }
}

/* y[M][N] (dt) = the rescaled product of the codes ([Mp][Kp], Mp = M rounded up to 32) with
 * the packed weight, its scales, bias, GELU and residual as qvl_rescale takes them. Returns 0,
 * -1 when out of memory, -2 without AMX tiles or for Kp % 64, N % 16, Kp > 65536. */
int qvl_amx_int8_matmul(const uint8_t* codes, const int8_t* wp, int64_t M, int64_t Kp, int64_t N,
                        const float* row_scale, const float* row_lo, const float* colsum, const void* col_scale,
                        const void* bias, int dt, int gelu, const void* residual, void* y, int threads) {
    if (!amx_granted) return -2;
    if (Kp % 64 || N % 16 || Kp > 65536) return -2; /* Kp <= 65536: 255 * 127 * Kp < 2^31 */
    float *cs, *b;
    if (qvl_rescale_columns(col_scale, bias, dt, N, &cs, &b)) return -1;
    const size_t es = dt == BF16 ? 2 : 4;
    const int64_t MB = (M + 31) / 32, NB = (N + 31) / 32, panels = (NB + I8_PANEL - 1) / I8_PANEL;
    const int64_t units = panels * MB, KC = Kp / 64;
    const int64_t T = threads < 1 ? 1 : threads;
#pragma omp parallel for num_threads(T) schedule(static, 1)
    for (int64_t t = 0; t < T; t++) { /* each thread a run of units, panel-major: its panel's weights stay put */
        const int64_t u0 = units * t / T, u1 = units * (t + 1) / T;
        _Alignas(64) int32_t sums[2][32 * 32];
        float tmp[32];
        int64_t prev_m0 = -1, prev_n0 = 0; /* the block whose sums wait in sums[1 - cur] */
        int cur = 0;
        if (u1 > u0) configure_full_tiles();
        /* a block's products are queued on the tiles before the previous block is rescaled, so
         * the vector units (the GELU above all) work while the tiles multiply */
        for (int64_t u = u0; u <= u1; u++) {
            const int64_t p = u / MB, m0 = u % MB * 32;
            const int64_t nb_end = u < u1 ? ((p + 1) * I8_PANEL < NB ? (p + 1) * I8_PANEL : NB) : p * I8_PANEL + 1;
            for (int64_t nb = p * I8_PANEL; nb < nb_end; nb++) {
                const int64_t n0 = nb * 32;
                if (u < u1) {
                    const int8_t* b0 = wp + (n0 / 16) * KC * 1024;
                    int8_block(codes + m0 * Kp, Kp, b0, b0 + KC * 1024, N - n0 >= 32);
                }
                if (prev_m0 >= 0)
                    rescale_block(sums[1 - cur], M - prev_m0 < 32 ? M - prev_m0 : 32, N - prev_n0 >= 32 ? 32 : 16,
                                  row_scale + prev_m0, row_lo + prev_m0, colsum + prev_n0, cs + prev_n0, b + prev_n0,
                                  dt, gelu, residual ? (const char*)residual + (prev_m0 * N + prev_n0) * es : NULL,
                                  (char*)y + (prev_m0 * N + prev_n0) * es, N, tmp);
                if (u == u1) break;
                sums_store(N - n0 >= 32, sums[cur]);
                prev_m0 = m0, prev_n0 = n0, cur = 1 - cur;
            }
        }
        if (u1 > u0) _tile_release();
    }
    free(cs);
    return 0;
}

/* ---- prefill's int8-weight products: 16-bit activations on int8 tiles ----
 * Each activation row is quantised to 16-bit codes q = round(x / s), s = max|x| / 32767 (as
 * precise as bf16 for values above 1/128 of the row's largest), split into bytes q = 256 hi +
 * lo (hi signed, lo unsigned). The weights [N][K] are A tiles read in place (16 rows x 64
 * columns), the byte planes B tiles; TDPBSSD and TDPBSUD sum exactly in int32 over all of K
 * (|sum| < 2^31 for K < 66,000), combined as 256 hi + lo in float32. No weight conversion,
 * so short prefills run at the tiles' rate. Tiles: sums 0-3 ([weight half][hi, lo]), weights
 * 4-5, hi 6, lo 7. */

/* Rows m0..m0+15 of x (dt; rows past M zero) -> their codes' byte planes as B tiles, per 64
 * columns 16 tile rows of 16 activation rows x 4 bytes (hi/lo [K/64][16][16][4]), and each
 * row's scale s[m]. K % 64 == 0. */
static void pack_rows_i16(const void* x, int dt, int64_t M, int64_t K, int64_t m0, int8_t* hi, uint8_t* lo,
                          float* s) {
    float inv[16];
    for (int m = 0; m < 16; m++) {
        const int64_t row = m0 + m;
        __m512 a = _mm512_setzero_ps();
        if (row < M)
            for (int64_t k = 0; k < K; k += 16) a = _mm512_max_ps(a, _mm512_abs_ps(load16_dt(x, dt, row * K + k)));
        const float top = _mm512_reduce_max_ps(a);
        inv[m] = top > 0.f ? 32767.f / top : 0.f;
        s[m] = top > 0.f ? top / 32767.f : 0.f;
    }
    for (int64_t kc = 0; kc < K / 64; kc++) {
        __m512 h[16], l[16]; /* row m's 64 codes as 16 dwords of 4 bytes, then transposed */
        for (int m = 0; m < 16; m++) {
            __m128i hb[4], lb[4];
            for (int j = 0; j < 4; j++) {
                const __m512 v = m0 + m < M ? load16_dt(x, dt, (m0 + m) * K + kc * 64 + 16 * j) : _mm512_setzero_ps();
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv[m]))); /* |q| <= 32767 */
                hb[j] = _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 8));
                lb[j] = _mm512_cvtepi32_epi8(q); /* truncation keeps the low byte */
            }
            h[m] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(hb[1], hb[0])),
                                                          _mm256_set_m128i(hb[3], hb[2]), 1));
            l[m] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(lb[1], lb[0])),
                                                          _mm256_set_m128i(lb[3], lb[2]), 1));
        }
        transpose16(h); /* h[r] = quad r of the 16 rows */
        transpose16(l);
        for (int r = 0; r < 16; r++) {
            _mm512_store_ps((float*)(hi + kc * 1024 + r * 64), h[r]);
            _mm512_store_ps((float*)(lo + kc * 1024 + r * 64), l[r]);
        }
    }
}

#define I16_SUB 4   /* weight blocks whose partial sums wait in L1 between parts of K */
#define I16_KPART 8 /* 64-column chunks per part: 16 KB of byte planes */
#define I16_PANEL_BYTES (512 << 10)

/* Tiles 0-3 += weight rows w0 (16) and w1 (16, when two) [.][KC][16][64] against one 16-row
 * block's byte planes, chunks kc0..kc1-1; from zero, or from the partial sums c [4][256]. */
static inline void i16_part(const int8_t* w0, const int8_t* w1, int64_t kc0, int64_t kc1, const int8_t* hi,
                            const uint8_t* lo, int two, const int32_t* c) {
    if (c) {
        _tile_loadd(0, c, 64);
        _tile_loadd(1, c + 256, 64);
        _tile_loadd(2, c + 512, 64);
        _tile_loadd(3, c + 768, 64);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kc = kc0; kc < kc1; kc++) {
        _tile_loadd(6, hi + kc * 1024, 64);
        _tile_loadd(7, lo + kc * 1024, 64);
        _tile_loadd(4, w0 + kc * 1024, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
        if (two) {
            _tile_loadd(5, w1 + kc * 1024, 64);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbsud(3, 5, 7);
        }
    }
}

static inline void i16_store(int32_t* c, int two) { /* [4][256]: hi, lo of each weight half */
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    if (two) {
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
    }
}

/* y[m0 + m][n0 + n] = (256 hi_sum + lo_sum)[n][m] * scale[n] * s[m] (+ bias[n]) for the 16 or
 * 32 weight rows of a block (sums [4][16][16]: hi and lo of each half), m < rows. */
static void write_i16_block(const int32_t* sums, int halves, const float* s, int64_t rows, const void* scale,
                            const void* bias, int dt, int64_t n0, int64_t N, void* y) {
    for (int half = 0; half < halves; half++) {
        const int32_t* hs = sums + 2 * half * 256;
        const int32_t* ls = hs + 256;
        const int64_t n = n0 + 16 * half;
        __m512 r[16];
        for (int i = 0; i < 16; i++)
            r[i] = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(hs + 16 * i)),
                                                 _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(_mm512_load_si512(ls + 16 * i))),
                                 _mm512_set1_ps(get(scale, dt, n + i)));
        transpose16(r);
        const __m512 b = bias ? load16_dt(bias, dt, n) : _mm512_setzero_ps();
        for (int64_t m = 0; m < rows; m++) {
            const __m512 v = _mm512_fmadd_ps(r[m], _mm512_set1_ps(s[m]), b);
            if (dt == BF16) {
#ifdef __AVX512BF16__
                _mm256_storeu_si256((__m256i*)((uint16_t*)y + m * N + n), (__m256i)_mm512_cvtneps_pbh(v));
#else
                float t[16];
                _mm512_storeu_ps(t, v);
                for (int i = 0; i < 16; i++) ((uint16_t*)y)[m * N + n + i] = f32_to_bf16(t[i]);
#endif
            } else {
                _mm512_storeu_ps((float*)y + m * N + n, v);
            }
        }
    }
}

/* y[M][N] (dt) = x [M][K] (dt) . (w [N][K] int8 * scale[N])^T (+ bias[N]), x in 16-bit codes per
 * row (see above). Each thread takes a run of (weight panel, 16-row block) units, panel-major.
 * Returns 0, -1 when out of memory, -2 without AMX tiles, for K % 64, N % 16 or K > 65536. */
int qvl_amx_i16_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const int8_t* w, const void* scale,
                       const void* bias, void* y, int threads) {
    if (!amx_granted) return -2;
    if (K % 64 || N % 16 || M < 1 || K > 65536) return -2; /* K <= 65536: the lo sums stay below 2^31 */
    const int64_t MB = (M + 15) / 16, NB = (N + 31) / 32, KC = K / 64;
    int8_t* hi = aligned_alloc(64, (size_t)(MB * KC * 1024));
    uint8_t* lo = aligned_alloc(64, (size_t)(MB * KC * 1024));
    float* s = malloc((size_t)(MB * 16) * sizeof(float));
    if (!hi || !lo || !s) {
        free(hi), free(lo), free(s);
        return -1;
    }
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int64_t mb = 0; mb < MB; mb++)
        pack_rows_i16(x, dt, M, K, mb * 16, hi + mb * KC * 1024, lo + mb * KC * 1024, s + mb * 16);
    int64_t PB = I16_PANEL_BYTES / (32 * K); /* 32-row weight blocks per panel: the panel stays in L2 */
    PB = PB < I16_SUB ? I16_SUB : PB > I8_PANEL ? I8_PANEL : PB;
    const int64_t panels = (NB + PB - 1) / PB, units = panels * MB, T = threads < 1 ? 1 : threads;
    const size_t es = dt == BF16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel for num_threads(T) schedule(static, 1)
    for (int64_t t = 0; t < T; t++) {
        const int64_t u0 = units * t / T, u1 = units * (t + 1) / T;
        _Alignas(64) int32_t sums[4 * 256], part[I16_SUB * 1024];
        int8_t* panel = u1 > u0 ? aligned_alloc(64, (size_t)(PB * 32 * K)) : NULL;
        int64_t have = -1; /* the panel whose weights `panel` holds */
        if (u1 > u0) configure_full_tiles();
        for (int64_t u = u0; u < u1 && panel; u++) {
            const int64_t p = u / MB, mb = u % MB, m0 = mb * 16, rows = M - m0 < 16 ? M - m0 : 16;
            const int64_t nb0 = p * PB, nb1 = (p + 1) * PB < NB ? (p + 1) * PB : NB;
            if (p != have) { /* its weight rows as whole 1 KB tiles: [16-row group][kc][16][64] */
                const int64_t groups = (N - nb0 * 32 < PB * 32 ? N - nb0 * 32 : PB * 32) / 16;
                for (int64_t g = 0; g < groups; g++)
                    for (int64_t kc = 0; kc < KC; kc++)
                        for (int r = 0; r < 16; r++)
                            _mm512_store_si512(panel + ((g * KC + kc) * 16 + r) * 64,
                                               _mm512_loadu_si512(w + (nb0 * 32 + g * 16 + r) * K + kc * 64));
                have = p;
            }
            /* K in parts: a part of this block's byte planes stays in L1 while the sums of a few
             * weight blocks go on from where the last part left them */
            for (int64_t nbs = nb0; nbs < nb1; nbs += I16_SUB) {
                const int64_t nbe = nbs + I16_SUB < nb1 ? nbs + I16_SUB : nb1;
                for (int64_t kp = 0; kp < KC; kp += I16_KPART) {
                    const int64_t kpe = kp + I16_KPART < KC ? kp + I16_KPART : KC;
                    for (int64_t nb = nbs; nb < nbe; nb++) {
                        const int64_t n0 = nb * 32;
                        const int two = N - n0 >= 32;
                        const int8_t* w0 = panel + 2 * (nb - nb0) * KC * 1024;
                        int32_t* c = part + (nb - nbs) * 1024;
                        i16_part(w0, w0 + KC * 1024, kp, kpe, hi + mb * KC * 1024, lo + mb * KC * 1024, two,
                                 kp == 0 ? NULL : c);
                        if (kpe < KC) {
                            i16_store(c, two);
                            continue;
                        }
                        i16_store(sums, two);
                        write_i16_block(sums, two ? 2 : 1, s + m0, rows, scale, bias, dt, n0, N,
                                        (char*)y + m0 * N * es);
                    }
                }
            }
        }
        if (u1 > u0) _tile_release();
        if (u1 > u0 && !panel) failed = 1;
        free(panel);
    }
    free(hi), free(lo), free(s);
    return failed ? -1 : 0;
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QVL_AMX_BF16 1
/* Many-row products with int8 or int4 weights in bf16 (prefill): y = x . w^T (+ bias), x and
 * y bf16 [M][K] and [M][N]. Each thread converts 32 weight rows at a time into two A tiles'
 * panel (no dequantised copy of the whole matrix, no repacking) and runs every 32 activation
 * rows over them, float32 sums over all of K. int8 codes are exact in bf16, so their row scale
 * comes after the sum; int4 groups are dequantised into the panel as qvl_dequantize does.
 * Tiles: sums 0-3 ([n-block][m-block]), weights 4-5, activations 6-7. */
/* Activation rows m0..m0+15 as B tiles: per 32 columns, 16 tile rows (column pairs) of 16 rows x
 * 2 bf16 (xb [K/32][16][16] pairs); rows past M are zero. */
static void pack_rows_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t m0, uint32_t* xb) {
    const __m512i pair_rows = lanes_times(16);
    for (int m = 0; m < 16; m++)
        for (int64_t kb = 0; kb < K / 32; kb++) {
            const __m512i v = m0 + m < M ? _mm512_loadu_si512(x + (m0 + m) * K + kb * 32) : _mm512_setzero_si512();
            _mm512_i32scatter_epi32(xb + kb * 256 + m, pair_rows, v, 4);
        }
}

/* 32 weight rows [32][K] -> two A tiles' panels of 16 rows, each 32 columns after 32 columns
 * as contiguous 16 x 32 blocks ([2][K/32][16][32] bf16): every tile load reads 1 KB in a row
 * (16 rows K apart would share cache sets). */
static void convert_rows_bf16(const int8_t* w, int64_t K, uint16_t* panel) {
    const int64_t KB = K / 32;
    for (int r = 0; r < 32; r++)
        for (int64_t kb = 0; kb < KB; kb++) {
            const __m256i b = _mm256_loadu_si256((const __m256i*)(w + r * K + kb * 32));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
            uint16_t* at = panel + (((r / 16) * KB + kb) * 16 + r % 16) * 32;
            _mm512_store_si512(at, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
}

/* The same panel from 32 rows of int4 nibbles [32][K/2] (even column in the low nibble), each
 * group of gs columns dequantised as q * s + (z - 8 s) with its scale and zero (as
 * qvl_dequantize), then rounded to bf16. */
static void convert_rows_int4(const uint8_t* w, const void* scale, const void* zero, int64_t gs, int dt, int64_t K,
                              uint16_t* panel) {
    const int64_t KB = K / 32, G = K / gs;
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int r = 0; r < 32; r++)
        for (int64_t kb = 0; kb < KB; kb++) {
            const int64_t g = r * G + kb * 32 / gs;
            const float sc = get(scale, dt, g);
            const __m512 s = _mm512_set1_ps(sc), z = _mm512_set1_ps(get(zero, dt, g) - 8.f * sc);
            const __m128i b = _mm_loadu_si128((const __m128i*)(w + r * (K / 2) + kb * 16));
            const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
            const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
            const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
            uint16_t* at = panel + (((r / 16) * KB + kb) * 16 + r % 16) * 32;
            _mm512_store_si512(at, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(c, s, z), _mm512_fmadd_ps(a, s, z)));
        }
}

/* y[m0 + m][n0 .. n0+15] for m < 16 and m0 + m < M from a sums tile out [16 n][16 m]
 * (transposed in registers). */
static void write_tile_bf16(const float* out, const void* scale, const void* bias, int dt, int64_t n0, int64_t m0,
                            int64_t M, int64_t N, uint16_t* y) { /* scale NULL: the panel holds scaled weights */
    const __m512 s = scale ? load16_dt(scale, dt, n0) : _mm512_set1_ps(1.f),
                 b = bias ? load16_dt(bias, dt, n0) : _mm512_setzero_ps();
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(out + 16 * i);
    transpose16(r);
    for (int m = 0; m < 16 && m0 + m < M; m++)
        _mm256_storeu_si256((__m256i*)(y + (m0 + m) * N + n0), (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(r[m], s, b)));
}

/* The sums of 32 weight rows (panel [32][K]) over 32 activation rows (x0, x1: their B tiles)
 * written to y: rows m0.. and columns n0.. */
static void tile_pair_bf16(const uint16_t* panel, const uint32_t* x0, const uint32_t* x1, int64_t K, const void* scale,
                           const void* bias, int dt, int64_t n0, int64_t m0, int64_t M, int64_t N, uint16_t* y) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < K / 32; kb++) {
        _tile_loadd(4, panel + kb * 512, 64);
        _tile_loadd(5, panel + (K / 32 + kb) * 512, 64);
        _tile_loadd(6, x0 + kb * 256, 64);
        _tile_loadd(7, x1 + kb * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    float out[4][256];
    _tile_stored(0, out[0], 64);
    _tile_stored(1, out[1], 64);
    _tile_stored(2, out[2], 64);
    _tile_stored(3, out[3], 64);
    for (int t = 0; t < 4; t++) write_tile_bf16(out[t], scale, bias, dt, n0 + (t / 2) * 16, m0 + (t % 2) * 16, M, N, y);
}

#define PANEL_BYTES (1 << 20) /* weight rows converted at a time per thread: L2-resident beside 32 activation rows */
/* Beyond 2^21 activation values (4 MB) every panel re-reads them from L3, and dequantising
 * once + oneDNN's GEMM wins: 2B's down_proj (K 6144) from 384 rows, 1.07-1.26x slower there;
 * 0.5-0.9x below (docs/decisions/amx.md). */
#define MAX_ACTIVATIONS (1 << 21)

/* kind W_INT8: w int8 [N][K] with a scale per row; W_INT4: nibbles [N][K/2] with a scale and a
 * zero per gs columns (gs a multiple of 32). Returns 1 when done, 0 when the shapes or the CPU
 * do not suit it, -1 when out of memory. */
int qvl_amx_bf16_linear(int kind, const uint16_t* x, int64_t M, int64_t K, int64_t N, const void* w, const void* scale,
                        const void* zero, int64_t gs, const void* bias, int dt, uint16_t* y, int threads) {
    if (!amx_granted || K % 32 || N % 32 || M < 1 || M * K > MAX_ACTIVATIONS) return 0;
    if (kind == W_INT4 && (gs <= 0 || gs % 32 || K % gs || !zero)) return 0;
    const int64_t MP = (M + 31) / 32, KB = K / 32; /* pairs of 16-row activation blocks */
    int64_t pairs = PANEL_BYTES / (64 * K); /* 32-row weight blocks per panel */
    pairs = pairs < 1 ? 1 : pairs;
    while (pairs > 1 && (N / 32 + pairs - 1) / pairs < threads) pairs /= 2; /* every thread gets panels */
    const int64_t panels = (N / 32 + pairs - 1) / pairs, esize = dt == BF16 ? 2 : 4;
    uint32_t* xb = aligned_alloc(64, (size_t)(MP * 2 * KB * 256) * 4);
    if (!xb) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t mb = 0; mb < 2 * MP; mb++) pack_rows_bf16(x, M, K, mb * 16, xb + mb * KB * 256);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t* panel = aligned_alloc(64, (size_t)(pairs * 32 * K) * 2);
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
        configure_full_tiles();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t first = p * pairs, count = first + pairs <= N / 32 ? pairs : N / 32 - first;
            if (!panel) continue;
            for (int64_t j = 0; j < count; j++) {
                const int64_t n0 = (first + j) * 32;
                if (kind == W_INT4)
                    convert_rows_int4((const uint8_t*)w + n0 * (K / 2), (const char*)scale + n0 * (K / gs) * esize,
                                      (const char*)zero + n0 * (K / gs) * esize, gs, dt, K, panel + j * 32 * K);
                else
                    convert_rows_bf16((const int8_t*)w + n0 * K, K, panel + j * 32 * K);
            }
            for (int64_t mp = 0; mp < MP; mp++)
                for (int64_t j = 0; j < count; j++)
                    tile_pair_bf16(panel + j * 32 * K, xb + 2 * mp * KB * 256, xb + (2 * mp + 1) * KB * 256, K,
                                   kind == W_INT4 ? NULL : scale, bias, dt, (first + j) * 32, mp * 32, M, N, y);
        }
        _tile_release();
        free(panel);
    }
    free(xb);
    return failed ? -1 : 1;
}
#endif
#else
int qvl_int8_amx_ready(void) { return 0; }

int qvl_amx_i16_linear(const void* x, int dt, int64_t M, int64_t K, int64_t N, const int8_t* w, const void* scale,
                       const void* bias, void* y, int threads) {
    (void)x, (void)dt, (void)M, (void)K, (void)N, (void)w, (void)scale, (void)bias, (void)y, (void)threads;
    return -2;
}

int qvl_amx_int8_matmul(const uint8_t* codes, const int8_t* wp, int64_t M, int64_t Kp, int64_t N,
                        const float* row_scale, const float* row_lo, const float* colsum, const void* col_scale,
                        const void* bias, int dt, int gelu, const void* residual, void* y, int threads) {
    (void)codes, (void)wp, (void)M, (void)Kp, (void)N, (void)row_scale, (void)row_lo, (void)colsum, (void)col_scale;
    (void)bias, (void)dt, (void)gelu, (void)residual, (void)y, (void)threads;
    return -2;
}

int64_t qvl_amx_codes_bytes(int64_t M, int64_t K) {
    (void)M, (void)K;
    return 0;
}
void qvl_amx_codes(const int16_t* q, const float* xs, int64_t M, int64_t K, char* mem, AmxCodes* a) {
    (void)q, (void)xs, (void)M, (void)K, (void)mem, (void)a;
}
void qvl_amx_block(const AmxCodes* a, const int8_t* w, int64_t b, float* own) { (void)a, (void)w, (void)b, (void)own; }
void qvl_amx_write(const AmxCodes* a, const float* own, const void* scale, const void* bias, int dt, int64_t b,
                   int64_t N, void* y) {
    (void)a, (void)own, (void)scale, (void)bias, (void)dt, (void)b, (void)N, (void)y;
}
void qvl_thread_done(void) {}
#endif

#ifndef QVL_AMX_BF16 /* no AMX-BF16 tiles in this build: the callers take their other paths */
int qvl_amx_bf16_linear(int kind, const uint16_t* x, int64_t M, int64_t K, int64_t N, const void* w, const void* scale,
                        const void* zero, int64_t gs, const void* bias, int dt, uint16_t* y, int threads) {
    (void)kind, (void)x, (void)M, (void)K, (void)N, (void)w, (void)scale, (void)zero, (void)gs, (void)bias, (void)dt;
    (void)y, (void)threads;
    return 0;
}

#endif

/* w [N][K] int8 -> wp, the B tiles of qvl_amx_int8_matmul: per 16 weight rows (output
 * columns) and 64 of K, 16 tile rows of 16 x 4 bytes (wp[nb][kc][r][c][i] = w[16 nb + c][64 kc
 * + 4 r + i]), K zero-padded to Kp = K rounded up to 64. N % 16 == 0; wp holds N * Kp bytes. */
void qvl_amx_pack_int8(const int8_t* w, int64_t N, int64_t K, int8_t* wp) {
    const int64_t KC = (K + 63) / 64;
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t kc = 0; kc < KC; kc++) {
            int8_t* t = wp + (nb * KC + kc) * 1024;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++)
                    for (int i = 0; i < 4; i++) {
                        const int64_t k = kc * 64 + 4 * r + i;
                        t[(r * 16 + c) * 4 + i] = k < K ? w[(nb * 16 + c) * K + k] : 0;
                    }
        }
}
