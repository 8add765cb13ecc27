/* Gated DeltaNet (Qwen3.5's linear-attention layers): the gated delta rule in chunks (prefill)
 * and one token per row over a pool of states (decode), and the short causal convolution
 * before it, in float32 on every tier. The delta rule per value head, per token t:
 *   S = S * exp(g_t);  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T q_t
 * with q and k L2-normalised (q also scaled by Dk^-0.5). The products run on GCC/Clang vector
 * types of the tier's width (AVX-512: 16 floats, AVX2: 8, NEON and portable: 4), so one source
 * serves every build. Threads split the value heads (prefill), the (row, head) pairs (decode
 * step) or the channels (convolution); each head's arithmetic is the same whatever the split. */
#include "team.h"

#if defined(QVL_AVX512)
#define VW 16
#define NV 4 /* vectors per column block of a product tile: 4 rows x 4 vectors of accumulators */
#elif defined(QVL_AVX2)
#define VW 8
#define NV 2 /* 16 registers */
#else
#define VW 4
#define NV 4
#endif
#define ROWS 4        /* rows of a product tile */
#define MAX_HEAD 256  /* Dk, Dv: multiples of 16 up to this */
#define LOG2E 1.4426950408889634f
typedef float vf __attribute__((vector_size(VW * 4)));

static inline vf vload(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float* p, vf v) { memcpy(p, &v, sizeof v); }

static inline float exp_neg(float x) { return exp2_poly(x * LOG2E); } /* e^x for x <= 0 */

/* dst[0..n) = src (dtype dt) as float32. */
static inline void load_row(const void* src, int dt, int64_t n, float* dst) {
    if (dt == BF16) {
        const uint16_t* s = (const uint16_t*)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* dst[0..n) (dtype dt) = src, rounded to nearest even. */
static inline void store_row(void* dst, int dt, const float* src, int64_t n) {
    if (dt == BF16) {
        uint16_t* d = (uint16_t*)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* C[0..R)[0..nv*VW) = c_scale * C + A[0..R)[0..K) B[0..K)[0..nv*VW) (c_scale 0: C not read). */
static inline __attribute__((always_inline)) void tile(const int R, const int nv, int64_t K, const float* A,
                                                       int64_t lda, const float* B, int64_t ldb, float* C,
                                                       int64_t ldc, float c_scale) {
    vf acc[ROWS][NV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = c_scale == 0.f ? (vf){0} : vload(C + r * ldc + v * VW) * c_scale;
    for (int64_t k = 0; k < K; k++) {
        vf b[NV];
        for (int v = 0; v < nv; v++) b[v] = vload(B + k * ldb + v * VW);
        for (int r = 0; r < R; r++) {
            const float a = A[r * lda + k];
            for (int v = 0; v < nv; v++) acc[r][v] += a * b[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < nv; v++) vstore(C + r * ldc + v * VW, acc[r][v]);
}

static inline __attribute__((always_inline)) void tile_rows(const int nv, int64_t M, int64_t K, const float* A,
                                                            int64_t lda, const float* B, int64_t ldb, float* C,
                                                            int64_t ldc, float c_scale) {
    int64_t m = 0;
    for (; m + ROWS <= M; m += ROWS) tile(ROWS, nv, K, A + m * lda, lda, B, ldb, C + m * ldc, ldc, c_scale);
    for (; m < M; m++) tile(1, nv, K, A + m * lda, lda, B, ldb, C + m * ldc, ldc, c_scale);
}

/* C [M][N] = c_scale * C + A [M][K] B [K][N], N a multiple of VW (row strides lda, ldb, ldc). */
static void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc, float c_scale) {
    int64_t n = 0;
    for (; n + NV * VW <= N; n += NV * VW) tile_rows(NV, M, K, A, lda, B + n, ldb, C + n, ldc, c_scale);
    for (; n < N; n += VW) tile_rows(1, M, K, A, lda, B + n, ldb, C + n, ldc, c_scale);
}

/* dst[0..D) = src (dtype dt) * scale / sqrt(sum src^2 + 1e-6), in float32 (transformers' l2norm). */
static inline void l2norm_row(const void* src, int dt, int64_t D, float scale, float* dst) {
    float ss = 0.f;
    load_row(src, dt, D, dst);
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; d++) ss += dst[d] * dst[d];
    const float inv = 1.f / sqrtf(ss + 1e-6f);
#pragma omp simd
    for (int64_t d = 0; d < D; d++) dst[d] = dst[d] * inv * scale;
}

/* The strides of one call's q, k, v (elements; D contiguous) and its shapes. */
typedef struct {
    const char *q, *k, *v;
    int dt;
    int64_t q_tok, q_head, k_tok, k_head, v_tok, v_head, Hk, Hv, Dk, Dv;
} Heads;

/* A chunk's working rows for one value head (L <= chunk tokens, LP = chunk rounded up to VW). */
typedef struct {
    float *x;   /* [2L][Dk]: the L normalised keys, then the L scaled queries */
    float *kt;  /* [Dk][LP]: the keys transposed (zero past L), then decayed to the chunk's end */
    float *xk;  /* [2L][LP]: A (beta_i k_i.k_j e^(b_i-b_j), j < i), then P (q_i.k_j e^(b_i-b_j), j <= i) */
    float *wy;  /* [2L][Dv]: K S, then Q S (the state before the chunk) */
    float *u;   /* [L][Dv]: the values written to the state */
    float *b;   /* [L]: the cumulative log decay inside the chunk */
    float *o;   /* [Dv]: one output row */
} Work;

/* Columns c..c+nv*VW of row i: the forward substitution u_i -= sum_{j<i} A_ij u_j (u_i holds
 * its right-hand side), then the output o_i = e^(b_i) (Q S)_i + sum_{j<=i} P_ij u_j. */
static inline __attribute__((always_inline)) void solve_columns(const int nv, int64_t i, int64_t c, const float* a,
                                                                const float* p, float* u, int64_t Dv,
                                                                const float* qs, float ebi, float* o) {
    vf ui[NV], oi[NV];
    for (int v = 0; v < nv; v++) ui[v] = vload(u + i * Dv + c + v * VW), oi[v] = vload(qs + c + v * VW) * ebi;
    for (int64_t j = 0; j < i; j++) {
        const float aj = a[j], pj = p[j];
        for (int v = 0; v < nv; v++) {
            const vf uj = vload(u + j * Dv + c + v * VW);
            ui[v] -= aj * uj;
            oi[v] += pj * uj;
        }
    }
    for (int v = 0; v < nv; v++) {
        oi[v] += p[i] * ui[v];
        vstore(u + i * Dv + c + v * VW, ui[v]);
        vstore(o + c + v * VW, oi[v]);
    }
}

/* One chunk of L tokens (t0.. of the call) for value head h: out rows written, S [Dk][Dv]
 * advanced past it. (I + A) U = beta (V - e^b K S); o_i = e^(b_i) S^T q_i + sum_{j <= i} P_ij u_j;
 * S = e^(b_L) S + sum_j e^(b_L - b_j) k_j u_j^T. */
static void delta_chunk(const Heads* x, int64_t h, int64_t t0, int64_t L, int64_t LP, const float* g,
                        const float* beta, float* S, void* out, Work w) {
    const int64_t Dk = x->Dk, Dv = x->Dv, Hv = x->Hv, kh = h / (Hv / x->Hk);
    const size_t es = x->dt == BF16 ? 2 : 4;
    const float scale = 1.f / sqrtf((float)Dk);
    for (int64_t i = 0; i < L; i++) {
        const int64_t t = t0 + i;
        l2norm_row(x->k + (t * x->k_tok + kh * x->k_head) * es, x->dt, Dk, 1.f, w.x + i * Dk);
        l2norm_row(x->q + (t * x->q_tok + kh * x->q_head) * es, x->dt, Dk, scale, w.x + (L + i) * Dk);
        w.b[i] = (i ? w.b[i - 1] : 0.f) + g[t * Hv + h];
    }
    for (int64_t d = 0; d < Dk; d++)
        for (int64_t j = 0; j < LP; j++) w.kt[d * LP + j] = j < L ? w.x[j * Dk + d] : 0.f;
    gemm(2 * L, LP, Dk, w.x, Dk, w.kt, LP, w.xk, LP, 0.f);
    gemm(2 * L, Dv, Dk, w.x, Dk, S, Dv, w.wy, Dv, 0.f);
    for (int64_t i = 0; i < L; i++) {
        const float bi = w.b[i], betai = beta[(t0 + i) * Hv + h], ebi = expf(bi);
        float *a = w.xk + i * LP, *p = w.xk + (L + i) * LP;
        const float* b = w.b;
#pragma omp simd
        for (int64_t j = 0; j <= i; j++) {
            const float e = exp_neg(bi - b[j]);
            a[j] *= betai * e;
            p[j] *= e;
        }
        float *ui = w.u + i * Dv, *ks = w.wy + i * Dv;
        load_row(x->v + ((t0 + i) * x->v_tok + h * x->v_head) * es, x->dt, Dv, ui);
#pragma omp simd
        for (int64_t c = 0; c < Dv; c++) ui[c] = betai * (ui[c] - ebi * ks[c]);
    }
    for (int64_t i = 0; i < L; i++) { /* forward substitution, each row's output as soon as its value is known */
        const float *a = w.xk + i * LP, *p = w.xk + (L + i) * LP, *qs = w.wy + (L + i) * Dv, ebi = expf(w.b[i]);
        int64_t c = 0;
        for (; c + NV * VW <= Dv; c += NV * VW) solve_columns(NV, i, c, a, p, w.u, Dv, qs, ebi, w.o);
        for (; c < Dv; c += VW) solve_columns(1, i, c, a, p, w.u, Dv, qs, ebi, w.o);
        store_row((char*)out + ((t0 + i) * Hv + h) * Dv * es, x->dt, w.o, Dv);
    }
    const float last = w.b[L - 1];
    for (int64_t j = 0; j < L; j++) w.b[j] = exp_neg(last - w.b[j]); /* the decay from each token to the chunk's end */
    for (int64_t d = 0; d < Dk; d++)
#pragma omp simd
        for (int64_t j = 0; j < L; j++) w.kt[d * LP + j] *= w.b[j];
    gemm(Dk, Dv, L, w.kt, LP, w.u, Dv, S, Dv, expf(last));
}

static int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

/* The gated delta rule over T tokens of one row, in chunks of `chunk` tokens ending at absolute
 * multiples of it (token 0 at absolute position `offset`): each chunk computed from its own
 * tokens and the state before it, so slices ending at such multiples give the same bits as one
 * call. q, k: token t, key head h at t*q_tok + h*q_head (elements, Dk contiguous), v likewise
 * (Dv), all of dtype dt; g, beta: [T][Hv] float32; state: [Hv][Dk][Dv] float32, updated in
 * place; out: [T][Hv][Dv] of dtype dt. Value head h reads key head h / (Hv / Hk). Returns 0,
 * -1 when out of memory, -2 for shapes it does not take (Dk, Dv multiples of 16 up to 256;
 * chunk 1..256). */
int qvl_gated_delta_rule(const void* q, const void* k, const void* v, int dt, int64_t T, int64_t Hk, int64_t Hv,
                         int64_t Dk, int64_t Dv, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                         int64_t v_tok, int64_t v_head, const float* g, const float* beta, float* state, void* out,
                         int64_t offset, int64_t chunk, int threads) {
    if (Dk % 16 || Dv % 16 || Dk > MAX_HEAD || Dv > MAX_HEAD || Hk < 1 || Hv % Hk || chunk < 1 || chunk > 256 ||
        offset < 0)
        return -2;
    const Heads x = {q, k, v, dt, q_tok, q_head, k_tok, k_head, v_tok, v_head, Hk, Hv, Dk, Dv};
    const int64_t LP = round_up(chunk, VW);
    const size_t floats = (size_t)(2 * chunk * Dk + Dk * LP + 2 * chunk * LP + 3 * chunk * Dv + chunk + Dv);
    int failed = 0;
    /* runs of heads taken in turn, two per thread (a thread on a core another program shares takes fewer) */
    const int team = threads < 1 ? 1 : threads;
    const int64_t parts = 2 * team < Hv ? 2 * team : Hv;
#pragma omp parallel for num_threads(team) schedule(dynamic, 1)
    for (int64_t part = 0; part < parts; part++) {
        const int64_t h0 = Hv * part / parts, h1 = Hv * (part + 1) / parts;
        float* buf = malloc(floats * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        Work w;
        w.x = buf, w.kt = w.x + 2 * chunk * Dk, w.xk = w.kt + Dk * LP, w.wy = w.xk + 2 * chunk * LP;
        w.u = w.wy + 2 * chunk * Dv, w.b = w.u + chunk * Dv, w.o = w.b + chunk;
        /* chunk by chunk, each of this part's heads in turn: a chunk's rows (one token's q, k and v
         * lie kilobytes apart) are fetched once for all of them, not once per head */
        for (int64_t t0 = 0; t0 < T;) {
            const int64_t end = (offset + t0) / chunk * chunk + chunk - offset, L = (end < T ? end : T) - t0;
            for (int64_t h = h0; h < h1; h++) delta_chunk(&x, h, t0, L, round_up(L, VW), g, beta, state + h * Dk * Dv,
                                                          out, w);
            t0 += L;
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* Item (b, h) = b * Hv + h of the delta rule's decode step (QvlDeltaStep in common.h): row b's
 * value head h, its state read once from memory: per block of columns (in L1), S^T k and S^T q
 * of the old state, then u = beta (v - e^g S^T k), o = e^g S^T q + (k.q) u (= the new state's
 * S^T q) and S = e^g S + k u^T, in place. */
static int delta_step_item(const void* ctx, const TeamItem* it) {
    const QvlDeltaStep* a = (const QvlDeltaStep*)ctx;
    const int dt = a->dt;
    const int64_t item = it->index, Hv = a->Hv, Dk = a->Dk, Dv = a->Dv;
    const int64_t b = item / Hv, h = item % Hv, kh = h / (Hv / a->Hk);
    const size_t es = dt == BF16 ? 2 : 4;
    float qn[MAX_HEAD], kn[MAX_HEAD], o[MAX_HEAD];
    l2norm_row((const char*)a->k + (b * a->k_tok + kh * a->k_head) * es, dt, Dk, 1.f, kn);
    l2norm_row((const char*)a->q + (b * a->q_tok + kh * a->q_head) * es, dt, Dk, 1.f / sqrtf((float)Dk), qn);
    float kq = 0.f;
    for (int64_t d = 0; d < Dk; d++) kq += kn[d] * qn[d];
    const float decay = expf(a->g[item]), bt = a->beta[item];
    const char* vr = (const char*)a->v + (b * a->v_tok + h * a->v_head) * es;
    float* S = a->states + (a->slots[b] * Hv + h) * Dk * Dv;
    for (int64_t c = 0; c < Dv; c += VW) {
        vf sk = {0}, sq = {0}, vv;
        for (int64_t d = 0; d < Dk; d++) {
            const vf s = vload(S + d * Dv + c);
            sk += kn[d] * s;
            sq += qn[d] * s;
        }
        for (int i = 0; i < VW; i++) vv[i] = get(vr, dt, c + i);
        const vf u = bt * (vv - decay * sk);
        vstore(o + c, decay * sq + kq * u);
        for (int64_t d = 0; d < Dk; d++) vstore(S + d * Dv + c, decay * vload(S + d * Dv + c) + kn[d] * u);
    }
    for (int64_t c = 0; c < Dv; c++) put(a->out, dt, item * Dv + c, o[c]);
    return 0;
}

int qvl_delta_step_fits(const QvlDeltaStep* a) {
    return !(a->Dk % 16 || a->Dv % 16 || a->Dk > MAX_HEAD || a->Dv > MAX_HEAD || a->Hk < 1 || a->Hv % a->Hk);
}

/* The decode step's (row, value head) items, in turn, each state updated in place (not taken over). */
TeamJob qvl_delta_step_job(const QvlDeltaStep* a) { return (TeamJob){a->B * a->Hv, 0, delta_step_item, NULL, a}; }

/* One token per row for B rows: row b's q, k, v at b*q_tok + h*q_head (and likewise; D
 * contiguous, dtype dt), g, beta [B][Hv] float32, its state states[slots[b]] ([Hv][Dk][Dv]
 * float32 each) updated in place, out [B][Hv][Dv] of dtype dt (delta_step_item). Each row
 * computed alike whatever the other rows. Returns 0, -1 out of memory, or -2 for shapes it does
 * not take. */
int qvl_gated_delta_step(const void* q, const void* k, const void* v, int dt, int64_t B, int64_t Hk, int64_t Hv,
                         int64_t Dk, int64_t Dv, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                         int64_t v_tok, int64_t v_head, const float* g, const float* beta, float* states,
                         const int64_t* slots, void* out, int threads) {
    const QvlDeltaStep a = {q, k, v, dt, B, Hk, Hv, Dk, Dv, q_tok, q_head, k_tok, k_head, v_tok, v_head, g, beta,
                            states, slots, out};
    if (!qvl_delta_step_fits(&a)) return -2;
    const TeamJob job = qvl_delta_step_job(&a);
    return team_region(B * Hv > 1 ? threads : 1, 0, 0, team_one_job, &job, NULL) ? -1 : 0;
}

/* silu(s) after rounding s to dt (the reference's conv runs in the weight's dtype). */
static inline float conv_silu(float s, int dt) {
    if (dt == BF16) s = bf16_to_f32(f32_to_bf16(s));
    const float e = exp_neg(-fabsf(s)); /* e^-|s|: s / (1 + e^-s) without overflow */
    return (s >= 0.f ? s : s * e) / (1.f + e);
}

/* The short causal convolution of one row: out[t][c] = silu(sum_j w[c][j] in[t - K + 1 + j][c])
 * with in[-K+1..-1] the row's K-1 earlier inputs, state [C][K-1] (oldest first), updated in
 * place to the last K-1 inputs. x: token t at t*x_tok (C contiguous); w [C][K]; state, out
 * [T][C]: all dtype dt. Threads take items of CONV_TOKENS tokens x CONV_CHANNELS channels in
 * turn (an item's inputs and weights stay in the first-level cache); each output is summed in
 * the same order whatever the split. Returns 0, or -2 for K outside 2..8. */
enum { CONV_TOKENS = 64, CONV_CHANNELS = 256 };

/* in[at][c] of the convolution's input: x at at >= 0, else the state's entry (K-1+at). */
static inline float conv_input(const void* x, int dt, int64_t x_tok, const void* state, int64_t K, int64_t at,
                               int64_t c) {
    return at >= 0 ? get(x, dt, at * x_tok + c) : get(state, dt, c * (K - 1) + K - 1 + at);
}

/* Tokens t0..t1 (all at t >= K - 1, so their windows lie inside x) of channels c0..c0+n: each
 * output summed over the window in ascending j and written through SiLU, in one pass over the
 * channels (K a compile-time constant where the caller gives one: the sums stay in registers). */
static inline __attribute__((always_inline)) void conv_window(const void* x, int dt, int64_t C, int64_t x_tok,
                                                               const float* wt, int64_t K, int64_t t0, int64_t t1,
                                                               int64_t c0, int64_t n, void* out) {
    const size_t es = dt == BF16 ? 2 : 4;
    for (int64_t t = t0; t < t1; t++) {
        const char* base = (const char*)x + ((t - K + 1) * x_tok + c0) * es;
        if (dt == BF16) {
            uint16_t* o = (uint16_t*)out + t * C + c0;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) {
                float s = 0.f;
                for (int64_t j = 0; j < K; j++) s += wt[j * n + c] * bf16_to_f32(((const uint16_t*)(base + j * x_tok * es))[c]);
                o[c] = f32_to_bf16(conv_silu(s, BF16));
            }
        } else {
            float* o = (float*)out + t * C + c0;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) {
                float s = 0.f;
                for (int64_t j = 0; j < K; j++) s += wt[j * n + c] * ((const float*)(base + j * x_tok * es))[c];
                o[c] = conv_silu(s, F32);
            }
        }
    }
}

int qvl_causal_conv(const void* x, int dt, int64_t T, int64_t C, int64_t x_tok, const void* w, int64_t K, void* state,
                    void* out, int threads) {
    if (K < 2 || K > 8) return -2;
    const int64_t blocks = (T + CONV_TOKENS - 1) / CONV_TOKENS, chunks = (C + CONV_CHANNELS - 1) / CONV_CHANNELS;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < blocks * chunks; item++) {
        const int64_t t0 = item / chunks * CONV_TOKENS, c0 = item % chunks * CONV_CHANNELS;
        const int64_t t1 = t0 + CONV_TOKENS < T ? t0 + CONV_TOKENS : T, n = C - c0 < CONV_CHANNELS ? C - c0 : CONV_CHANNELS;
        float wt[8 * CONV_CHANNELS]; /* weights [K][n] */
        for (int64_t c = 0; c < n; c++)
            for (int64_t j = 0; j < K; j++) wt[j * n + c] = get(w, dt, (c0 + c) * K + j);
        int64_t t = t0;
        for (; t < t1 && t < K - 1; t++) { /* windows reaching into the state */
            for (int64_t c = 0; c < n; c++) {
                float s = 0.f;
                for (int64_t j = 0; j < K; j++) s += wt[j * n + c] * conv_input(x, dt, x_tok, state, K, t - K + 1 + j, c0 + c);
                put(out, dt, t * C + c0 + c, conv_silu(s, dt));
            }
        }
        if (K == 4)
            conv_window(x, dt, C, x_tok, wt, 4, t, t1, c0, n, out);
        else
            conv_window(x, dt, C, x_tok, wt, K, t, t1, c0, n, out);
    }
    /* the state moves on once every item has read it: the last K-1 inputs, oldest first
       (ascending j reads old entries not yet overwritten) */
    for (int64_t c = 0; c < C; c++)
        for (int64_t j = 0; j < K - 1; j++) put(state, dt, c * (K - 1) + j, conv_input(x, dt, x_tok, state, K, T - (K - 1) + j, c));
    return 0;
}

/* Channels c0..c1 of one row's convolution step: x (C values) after the K-1 earlier ones in
 * state ([C][K-1], oldest first; shifted in place), w [C][K], out: all dtype dt, summed in
 * prefill's order. K and dt are constants where the caller gives them (the loops unroll and
 * the channels vectorise). */
static inline __attribute__((always_inline)) void conv_step_channels(const void* x, const int dt, const void* w,
                                                                      const int64_t K, void* state, void* out,
                                                                      int64_t c0, int64_t c1) {
#pragma omp simd
    for (int64_t c = c0; c < c1; c++) {
        const int64_t at = c * (K - 1);
        const float xi = get(x, dt, c);
        float s = 0.f;
        for (int64_t j = 0; j < K - 1; j++) s += get(w, dt, c * K + j) * get(state, dt, at + j);
        s += get(w, dt, c * K + K - 1) * xi;
        for (int64_t j = 0; j < K - 2; j++) {
            if (dt == BF16)
                ((uint16_t*)state)[at + j] = ((const uint16_t*)state)[at + j + 1];
            else
                ((float*)state)[at + j] = ((const float*)state)[at + j + 1];
        }
        if (dt == BF16) {
            ((uint16_t*)state)[at + K - 2] = f32_to_bf16(xi);
            ((uint16_t*)out)[c] = f32_to_bf16(conv_silu(s, BF16));
        } else {
            ((float*)state)[at + K - 2] = xi;
            ((float*)out)[c] = conv_silu(s, F32);
        }
    }
}

/* The convolution's decode step: row b's input x[b*x_tok ..] (C values) after its K-1 earlier
 * ones in states[slots[b]] ([C][K-1] each, oldest first; shifted in place), w [C][K], out
 * [B][C]: all dtype dt. Returns 0, or -2 for K outside 2..8. */
int qvl_causal_conv_step(const void* x, int dt, int64_t B, int64_t C, int64_t x_tok, const void* w, int64_t K,
                         void* states, const int64_t* slots, void* out, int threads) {
    if (K < 2 || K > 8) return -2;
    const size_t es = dt == BF16 ? 2 : 4;
    const int64_t run = 1024, runs = (C + run - 1) / run; /* channels per item */
#pragma omp parallel for num_threads(B * C >= 4 * run ? threads : 1) schedule(dynamic, 1)
    for (int64_t item = 0; item < B * runs; item++) {
        const int64_t b = item / runs, c0 = item % runs * run, c1 = c0 + run < C ? c0 + run : C;
        const char* xb = (const char*)x + b * x_tok * es;
        char* st = (char*)states + slots[b] * C * (K - 1) * es;
        char* ob = (char*)out + b * C * es;
        if (dt == BF16 && K == 4)
            conv_step_channels(xb, BF16, w, 4, st, ob, c0, c1);
        else if (dt == BF16)
            conv_step_channels(xb, BF16, w, K, st, ob, c0, c1);
        else if (K == 4)
            conv_step_channels(xb, F32, w, 4, st, ob, c0, c1);
        else
            conv_step_channels(xb, F32, w, K, st, ob, c0, c1);
    }
    return 0;
}
