/* A whole decode step through every decoder layer in one call (qvl_decode_layers), in bf16 or
 * float32, with the same kernels and roundings as the per-layer modules, run by the threads as
 * one team (team.h); and qvl_features, what this build has. */
#include "gemv.h"

/* What this build has, as bits: 1 AVX-512, 2 AVX-512 VNNI, 4 AVX512-BF16 (flash attention),
 * 8 AVX2+FMA, 16 AVX-VNNI, 32 NEON, 64 NEON dot products, 128 OpenMP, 256 AMX int8 tiles
 * (the int8 products of up to 64 rows), 512 NEON int8 matrix products (i8mm: the byte kernel's smmla). */
int qvl_features(void) {
    int f = 0;
#ifdef QVL_AVX512
    f |= 1 | 8;
#ifdef __AVX512VNNI__
    f |= 2;
#endif
#ifdef __AVX512BF16__
    f |= 4;
#endif
#endif
#ifdef QVL_AVX2
    f |= 8;
#ifdef __AVXVNNI__
    f |= 16;
#endif
#endif
#ifdef QVL_NEON
    f |= 32;
#ifdef __ARM_FEATURE_DOTPROD
    f |= 64;
#endif
#if defined(__ARM_FEATURE_DOTPROD) && defined(__ARM_FEATURE_MATMUL_INT8) /* the byte kernel's smmla */
    f |= 512;
#endif
#endif
#ifdef _OPENMP
    f |= 128;
#endif
    if (qvl_int8_amx_ready()) f |= 256;
    return f;
}

/* ---- a whole decode step through the decoder layers ---- */

/* Which experts a mixture layer's rows chose (kept for the whole step: a thread that fell behind
 * reads the same choice when it passes that layer). */
typedef struct {
    int64_t experts;  /* chosen by some row, in ascending order */
    int64_t* expert;  /* [S]: their numbers */
    int64_t* rows;    /* [S]: rows that chose each */
    int64_t* member;  /* [S][B]: those rows */
    int64_t* rank;    /* [S][B]: the expert's place among each row's top_k */
    float* weight;    /* [B][top_k]: each row's weights, renormalised over its top_k and rounded to dt */
} Routing;

/* The step's buffers (of the compute dtype unless said), laid out once for the whole step. */
typedef struct {
    char *xn, *a;                          /* [B][D]: normed rows, a block's output */
    char *q, *att, *k, *v, *qg;            /* attention: [B][H][hd] x2, [B][Hkv][hd] x2, [B][H][2 hd] */
    char *g, *u;                           /* [B][I]: the dense MLP's or the shared expert's */
    char *mixed, *y, *z, *o, *bl, *al;     /* Gated DeltaNet: [B][C] x2, [B][Hv Dv] x2, [B][Hv] x2 */
    float *dg, *beta;                      /* [B][Hv] float32 */
    char *logits, *score, *shared;         /* mixture: [B][E], [B], [B][D] */
    char *gu, *dn, *rows;                  /* [S][B][2 inter], [S][B][D], [B][max(D, inter)] */
    GemvInput in_x, in_att, in_h, in_delta; /* the products' inputs: xn, att, g, o */
    GemvInput *in_gu, *in_dn;              /* [S]: each chosen expert's rows, and its down input */
    Routing* routing;                      /* [layers] */
} Buffers;

/* What every thread's program reads: the layers, the model's shapes, the rows, their cache and
 * states, the buffers. */
typedef struct {
    const QvlLayer* layers;
    int64_t n_layers;
    const QvlShape* s;
    int dt, threads;
    int64_t B, S, I; /* rows; chosen experts at most; the dense MLP's widest */
    size_t es;
    char* x;
    const char *cos, *sin; /* [B][rotary_dim] */
    char *keys, *values;
    int64_t layer_stride, table_stride, block, block_stride, head_stride;
    const int64_t *table, *slots, *lengths;
    const QvlStates* states;
    Buffers* b;
} Step;

/* Where a thread's program is: the layer, and its index among the attention or DeltaNet layers. */
typedef struct {
    const Step* t;
    const QvlLayer* L;
    int64_t layer, attention, delta;
} Here;

static void add_into(void* x, const void* a, int dt, int64_t n) { /* one loop per dtype: they vectorise */
    if (dt == BF16) {
        uint16_t* xb = (uint16_t*)x;
        const uint16_t* ab = (const uint16_t*)a;
        for (int64_t i = 0; i < n; i++) xb[i] = f32_to_bf16(bf16_to_f32(xb[i]) + bf16_to_f32(ab[i]));
    } else {
        float* xf = (float*)x;
        const float* af = (const float*)a;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) xf[i] += af[i];
    }
}

static inline float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

/* RMSNorm of `rows` rows of `dim` (out may be x): qvl_rmsnorm, or qvl_rmsnorm_zero_centred (Qwen3.5). */
static void norm_rows(const Step* t, const void* x, const void* w, void* out, int64_t rows, int64_t dim) {
    (t->s->zero_centred ? qvl_rmsnorm_zero_centred : qvl_rmsnorm)(x, w, out, t->dt, rows, dim, t->s->eps, 1);
}

/* ---- the products ---- */

/* The forms in which the linears ls[0..n) read one input of M rows, and the int4 weights' group
 * size (*gs; -1 when two differ: the kernels do not take that). */
static int forms_of(const QvlLinear* const* ls, int n, int64_t M, int64_t* gs) {
    int forms = 0;
    *gs = 0;
    for (int i = 0; i < n; i++) {
        forms |= qvl_gemv_forms(ls[i], M);
        if (ls[i]->kind == W_INT4) *gs = *gs && *gs != ls[i]->group_size ? -1 : ls[i]->group_size;
    }
    return forms;
}

/* x [M][K] as the input `in` of the linears ls[0..n). */
static void prepare(const Step* t, GemvInput* in, const QvlLinear* const* ls, int n, const void* x, int64_t M) {
    int64_t gs;
    const int forms = forms_of(ls, n, M, &gs);
    qvl_gemv_prepare(in, forms, x, t->dt, M, gs, 1);
}

/* x [B][K] as the input `in` of the one linear l. */
static int prepare_one(const Step* t, GemvInput* in, const QvlLinear* l, const void* x) {
    prepare(t, in, &l, 1, x, t->B);
    return 0;
}

/* The products ls[i] . ins[i] -> ys[i] for i < n as one job, run by w; without w, counted:
 * *items and *own raised to its items and its largest own result. */
static int products(Walker* w, const Step* t, int n, const QvlLinear* const* ls, const GemvInput* const* ins,
                    void* const* ys, int64_t* items, int64_t* own) {
    GemvProduct p[n];
    int64_t first[n + 1];
    first[0] = 0;
    for (int i = 0; i < n; i++) {
        int64_t gs;
        const int forms = forms_of(ls + i, 1, t->B, &gs);
        qvl_gemv_product(&p[i], ls[i], ins[i], forms, t->dt, ys[i], t->threads);
        first[i + 1] = first[i] + p[i].items;
        if (!w && qvl_gemv_own_floats(&p[i]) > *own) *own = qvl_gemv_own_floats(&p[i]);
    }
    if (!w) {
        *items = first[n] > *items ? first[n] : *items;
        return 0;
    }
    const GemvJob job = {n, p, first};
    const TeamJob tj = qvl_gemv_job(&job);
    return team_run(w, &tj);
}

/* The products of linears that all read `in`. */
static int products_of(Walker* w, const Step* t, int n, const QvlLinear* const* ls, const GemvInput* in,
                       void* const* ys, int64_t* items, int64_t* own) {
    const GemvInput* ins[n];
    for (int i = 0; i < n; i++) ins[i] = in;
    return products(w, t, n, ls, ins, ys, items, own);
}

/* The linears a layer's mixer reads its normed rows with (q, k, v, or the DeltaNet's four). */
static int mixer_linears(const QvlLayer* L, const QvlLinear** ls) {
    if (L->delta.out.n) {
        ls[0] = &L->delta.qkv, ls[1] = &L->delta.z, ls[2] = &L->delta.b, ls[3] = &L->delta.a;
        return 4;
    }
    ls[0] = &L->q, ls[1] = &L->k, ls[2] = &L->v;
    return 3;
}

/* The linears a layer's MLP reads its normed rows with: gate and up, or the router (then the
 * shared expert's score, gate and up where it has one). */
static int mlp_linears(const QvlLayer* L, const QvlLinear** ls) {
    if (!L->moe.experts) {
        ls[0] = &L->gate, ls[1] = &L->up;
        return 2;
    }
    ls[0] = &L->moe.router;
    if (!L->moe.shared_gate.n) return 1;
    ls[1] = &L->moe.shared_gate, ls[2] = &L->gate, ls[3] = &L->up;
    return 4;
}

/* ---- the serial parts: one thread runs each while the others wait ---- */

/* The previous layer's MLP output added to the hidden rows; the input norm; its products' input. */
static int mixer_in(const void* ctx) {
    const Here* h = (const Here*)ctx;
    const Step* t = h->t;
    Buffers* b = t->b;
    if (h->layer > 0) add_into(t->x, b->a, t->dt, t->B * t->s->D);
    norm_rows(t, t->x, h->L->input_norm, b->xn, t->B, t->s->D);
    const QvlLinear* ls[4];
    prepare(t, &b->in_x, ls, mixer_linears(h->L, ls), b->xn, t->B);
    return 0;
}

/* q from q_proj's query halves (gated), the q/k norms, RoPE on each head's first rotary_dim dims,
 * the new keys and values written at each row's position. */
static int attention_in(const void* ctx) {
    const Here* h = (const Here*)ctx;
    const Step* t = h->t;
    const QvlShape* s = t->s;
    Buffers* bf = t->b;
    const int dt = t->dt;
    const size_t es = t->es;
    const int64_t B = t->B, H = s->H, Hkv = s->Hkv, hd = s->hd, rd = s->rotary_dim;
    char *kc = t->keys + h->attention * t->layer_stride * es, *vc = t->values + h->attention * t->layer_stride * es;
    if (s->gated)
        for (int64_t r = 0; r < B * H; r++) memcpy(bf->q + r * hd * es, bf->qg + 2 * r * hd * es, (size_t)hd * es);
    norm_rows(t, bf->q, h->L->q_norm, bf->q, B * H, hd);
    norm_rows(t, bf->k, h->L->k_norm, bf->k, B * Hkv, hd);
    for (int64_t b = 0; b < B; b++) {
        const char *cos = t->cos + b * rd * es, *sin = t->sin + b * rd * es;
        for (int64_t i = 0; i < H; i++) qvl_text_rope_rows(bf->q + (b * H + i) * hd * es, dt, 1, rd, cos, sin);
        for (int64_t i = 0; i < Hkv; i++) {
            qvl_text_rope_rows(bf->k + (b * Hkv + i) * hd * es, dt, 1, rd, cos, sin);
            const int64_t at = (t->table[b * t->table_stride + t->slots[b] / t->block] * t->block_stride +
                                i * t->head_stride + t->slots[b] % t->block * hd) * es;
            memcpy(kc + at, bf->k + (b * Hkv + i) * hd * es, (size_t)hd * es);
            memcpy(vc + at, bf->v + (b * Hkv + i) * hd * es, (size_t)hd * es);
        }
    }
    return 0;
}

/* The attention's output times sigmoid(gate) where q_proj gives each head's gate after its query
 * (rounded as torch rounds them); o_proj's input. */
static int attention_out(const void* ctx) {
    const Here* h = (const Here*)ctx;
    const Step* t = h->t;
    Buffers* b = t->b;
    const int dt = t->dt;
    const int64_t hd = t->s->hd, rows = t->B * t->s->H;
    if (t->s->gated)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < hd; i++) {
                const float gate = in_dt(sigmoid(get(b->qg, dt, (2 * r + 1) * hd + i)), dt);
                put(b->att, dt, r * hd + i, get(b->att, dt, r * hd + i) * gate);
            }
    return prepare_one(t, &b->in_att, &h->L->o, b->att);
}

/* The DeltaNet between its products: beta = sigmoid(b) (rounded), g = -e^A_log softplus(a +
 * dt_bias) in float32, the short convolution's step on the rows' states. */
static int delta_mid(const void* ctx) {
    const Here* h = (const Here*)ctx;
    const Step* t = h->t;
    const QvlDelta* L = &h->L->delta;
    Buffers* b = t->b;
    const QvlShape* s = t->s;
    const int dt = t->dt;
    const int64_t Hv = s->Hv, C = 2 * s->Hk * s->Dk + Hv * s->Dv;
    for (int64_t i = 0; i < t->B * Hv; i++) {
        const float a = get(b->al, dt, i) + get(L->dt_bias, dt, i % Hv);
        b->beta[i] = in_dt(sigmoid(get(b->bl, dt, i)), dt);
        b->dg[i] = -expf(get(L->a_log, dt, i % Hv)) * (a > 20.f ? a : log1pf(expf(a)));
    }
    const QvlStates* st = t->states;
    return qvl_causal_conv_step(b->mixed, dt, t->B, C, C, L->conv,
                                s->K, (char*)st->conv + h->delta * st->slots * C * (s->K - 1) * t->es, st->rows,
                                b->y, 1) ? -2 : 0;
}

/* The gated RMSNorm per value head (float32 rms, times the weight after rounding, times silu(z)
 * in float32, rounded); out_proj's input. */
static int delta_out(const void* ctx) {
    const Here* h = (const Here*)ctx;
    const Step* t = h->t;
    Buffers* b = t->b;
    qvl_gated_rmsnorm(b->o, b->z, h->L->delta.norm, b->o, t->dt, t->B * t->s->Hv, t->s->Dv, t->s->eps, 1);
    return prepare_one(t, &b->in_delta, &h->L->delta.out, b->o);
}

/* The mixer's output added to the hidden rows; the post-attention norm; the MLP's input. */
static int mlp_in(const void* ctx) {
    const Here* h = (const Here*)ctx;
    const Step* t = h->t;
    Buffers* b = t->b;
    add_into(t->x, b->a, t->dt, t->B * t->s->D);
    norm_rows(t, t->x, h->L->post_norm, b->xn, t->B, t->s->D);
    const QvlLinear* ls[4];
    prepare(t, &b->in_x, ls, mlp_linears(h->L, ls), b->xn, t->B);
    return 0;
}

/* silu(gate) * up of the dense MLP (or the shared expert); down's input. */
static int dense_down_in(const void* ctx) {
    const Here* h = (const Here*)ctx;
    const Step* t = h->t;
    Buffers* b = t->b;
    qvl_silu_mul(b->g, b->u, t->dt, t->B * h->L->gate.n, 1);
    return prepare_one(t, &b->in_h, &h->L->down, b->g);
}

/* A mixture's routing, as qvl.model.text.SparseMoE computes it: router logits in dt, softmax in
 * float32, the top_k experts (ties to the lower index) with their probabilities renormalised over
 * the k and rounded to dt; each chosen expert's rows gathered as its gate_up input, in ascending
 * expert order. */
static int moe_route(const void* ctx) {
    const Here* h = (const Here*)ctx;
    const Step* t = h->t;
    const QvlMoe* m = &h->L->moe;
    Buffers* bf = t->b;
    Routing* r = &bf->routing[h->layer];
    const int dt = t->dt;
    const int64_t B = t->B, E = m->experts, K = m->top_k, D = t->s->D;
    int64_t chosen[B * K];
    float prob[E];
    for (int64_t b = 0; b < B; b++) {
        float top = -INFINITY, total = 0.f, kept = 0.f;
        for (int64_t e = 0; e < E; e++) top = fmaxf(top, get(bf->logits, dt, b * E + e));
        for (int64_t e = 0; e < E; e++) total += prob[e] = expf(get(bf->logits, dt, b * E + e) - top);
        for (int64_t e = 0; e < E; e++) prob[e] /= total;
        for (int64_t j = 0; j < K; j++) { /* the j-th largest, the lower index among equals */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= chosen[b * K + i] == e;
                if (!taken && (best < 0 || prob[e] > prob[best])) best = e;
            }
            chosen[b * K + j] = best;
            kept += prob[best];
        }
        for (int64_t j = 0; j < K; j++) {
            const float w = prob[chosen[b * K + j]] / kept;
            r->weight[b * K + j] = dt == BF16 ? round_bf(w) : w;
        }
    }
    r->experts = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t s = r->experts;
        int64_t n = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < K; j++)
                if (chosen[b * K + j] == e) r->member[s * B + n] = b, r->rank[s * B + n++] = j;
        if (!n) continue;
        r->expert[s] = e, r->rows[s] = n, r->experts++;
        for (int64_t i = 0; i < n; i++)
            memcpy(bf->rows + i * D * t->es, bf->xn + r->member[s * B + i] * D * t->es, (size_t)D * t->es);
        const QvlLinear* gu = &m->gate_up[e];
        prepare(t, &bf->in_gu[s], &gu, 1, bf->rows, n);
    }
    return 0;
}

/* silu(gate) * up of each chosen expert's rows (and of the shared expert's); down's inputs. */
static int moe_down_in(const void* ctx) {
    const Here* h = (const Here*)ctx;
    const Step* t = h->t;
    const QvlMoe* m = &h->L->moe;
    Buffers* bf = t->b;
    const Routing* r = &bf->routing[h->layer];
    const int64_t B = t->B, I = m->inter;
    const size_t es = t->es;
    for (int64_t s = 0; s < r->experts; s++) {
        const char* gu = bf->gu + s * B * 2 * I * es;
        for (int64_t i = 0; i < r->rows[s]; i++) {
            qvl_silu_mul((char*)gu + i * 2 * I * es, gu + (i * 2 * I + I) * es, t->dt, I, 1);
            memcpy(bf->rows + i * I * es, gu + i * 2 * I * es, (size_t)I * es);
        }
        const QvlLinear* down = &m->down[r->expert[s]];
        prepare(t, &bf->in_dn[s], &down, 1, bf->rows, r->rows[s]);
    }
    return m->shared_gate.n ? dense_down_in(ctx) : 0;
}

/* The experts' outputs times each row's weight (rounded), added into the row's output in
 * ascending expert order (rounded at each add); plus, where the layer has one, sigmoid(shared_gate
 * xn) times the shared expert's output (each step rounded as torch rounds it). */
static int moe_combine(const void* ctx) {
    const Here* h = (const Here*)ctx;
    const Step* t = h->t;
    Buffers* bf = t->b;
    const Routing* r = &bf->routing[h->layer];
    const int dt = t->dt;
    const int64_t B = t->B, D = t->s->D, K = h->L->moe.top_k;
    memset(bf->a, 0, (size_t)(B * D) * t->es);
    for (int64_t s = 0; s < r->experts; s++)
        for (int64_t i = 0; i < r->rows[s]; i++) {
            const int64_t row = r->member[s * B + i];
            const float w = r->weight[row * K + r->rank[s * B + i]];
            const char* dn = bf->dn + (s * B + i) * D * t->es;
            for (int64_t c = 0; c < D; c++) {
                const float v = get(dn, dt, c) * w, o = get(bf->a, dt, row * D + c);
                put(bf->a, dt, row * D + c, (dt == BF16 ? round_bf(v) : v) + o);
            }
        }
    if (!h->L->moe.shared_gate.n) return 0;
    for (int64_t b = 0; b < B; b++) {
        const float weight = in_dt(sigmoid(get(bf->score, dt, b)), dt);
        for (int64_t c = 0; c < D; c++)
            put(bf->a, dt, b * D + c, get(bf->a, dt, b * D + c) + in_dt(weight * get(bf->shared, dt, b * D + c), dt));
    }
    return 0;
}

/* The last layer's MLP output added to the hidden rows. */
static int finish(const void* ctx) {
    const Step* t = ((const Here*)ctx)->t;
    add_into(t->x, t->b->a, t->dt, t->B * t->s->D);
    return 0;
}

/* ---- the layers as jobs ---- */

/* Attention for the normed rows (in_x) -> a: q/k/v, attention_in, attention over each row's
 * positions 0..slots[b] (the decode attention's job), attention_out, o_proj. Without w: its
 * jobs' items and own results counted (*items the most of any, *own likewise). */
static int attention(Walker* w, const Here* h, int64_t* items, int64_t* own) {
    const Step* t = h->t;
    Buffers* b = t->b;
    const QvlShape* s = t->s;
    const QvlLayer* L = h->L;
    const QvlLinear* ls[3] = {&L->q, &L->k, &L->v};
    void* ys[3] = {s->gated ? b->qg : b->q, b->k, b->v};
    const QvlAttention att = {b->q, t->keys + h->attention * t->layer_stride * t->es,
                              t->values + h->attention * t->layer_stride * t->es, t->dt, t->table, t->table_stride,
                              t->block, t->block_stride, t->head_stride, t->B, s->H, s->Hkv, t->lengths, s->hd, b->att};
    const TeamJob heads = qvl_decode_attention_job(&att);
    const QvlLinear* o = &L->o;
    if (!w) {
        products_of(NULL, t, 3, ls, &b->in_x, ys, items, own);
        products_of(NULL, t, 1, &o, &b->in_att, (void* const*)&b->a, items, own);
        *items = heads.items > *items ? heads.items : *items;
        *own = (s->H / s->Hkv) * s->hd > *own ? (s->H / s->Hkv) * s->hd : *own;
        return 0;
    }
    int status = products_of(w, t, 3, ls, &b->in_x, ys, NULL, NULL);
    if (!status) status = team_serial(w, attention_in, h);
    if (!status) status = team_run(w, &heads);
    if (!status) status = team_serial(w, attention_out, h);
    if (!status) status = products_of(w, t, 1, &o, &b->in_att, (void* const*)&b->a, NULL, NULL);
    return status;
}

/* A Gated DeltaNet layer for the normed rows (in_x) -> a, as qvl.model.gated_deltanet computes a
 * decode step: in_proj_qkv/z/b/a, delta_mid, the delta rule's step on the rows' states (items
 * in place), delta_out, out_proj. Without w: counted, as attention. */
static int delta_layer(Walker* w, const Here* h, int64_t* items, int64_t* own) {
    const Step* t = h->t;
    Buffers* b = t->b;
    const QvlShape* s = t->s;
    const QvlDelta* L = &h->L->delta;
    const QvlLinear* ls[4] = {&L->qkv, &L->z, &L->b, &L->a};
    void* ys[4] = {b->mixed, b->z, b->bl, b->al};
    const QvlLinear* out = &L->out;
    if (!w) {
        products_of(NULL, t, 4, ls, &b->in_x, ys, items, own);
        return products_of(NULL, t, 1, &out, &b->in_delta, (void* const*)&b->a, items, own);
    }
    const int64_t Hk = s->Hk, Dk = s->Dk, C = 2 * Hk * Dk + s->Hv * s->Dv;
    const QvlStates* st = t->states;
    const QvlDeltaStep step = {b->y, b->y + Hk * Dk * t->es, b->y + 2 * Hk * Dk * t->es, t->dt, t->B, Hk, s->Hv, Dk,
                               s->Dv, C, Dk, C, Dk, C, s->Dv, b->dg, b->beta,
                               st->recurrent + h->delta * st->slots * s->Hv * Dk * s->Dv, st->rows, b->o};
    const TeamJob heads = qvl_delta_step_job(&step);
    int status = products_of(w, t, 4, ls, &b->in_x, ys, NULL, NULL);
    if (!status) status = team_serial(w, delta_mid, h);
    if (!status) status = team_run(w, &heads);
    if (!status) status = team_serial(w, delta_out, h);
    if (!status) status = products_of(w, t, 1, &out, &b->in_delta, (void* const*)&b->a, NULL, NULL);
    return status;
}

/* A mixture's experts as one job: gate_up (down: down) of each chosen expert (or, counting, of
 * the S first ones) on its rows, plus the shared expert's down when `shared`. */
static int experts(Walker* w, const Here* h, int down, int64_t* items, int64_t* own) {
    const Step* t = h->t;
    Buffers* bf = t->b;
    const QvlMoe* m = &h->L->moe;
    const Routing* r = &bf->routing[h->layer];
    const int64_t n = w ? r->experts : t->S, shared = down && m->shared_gate.n, B = t->B;
    const QvlLinear* ls[n + 1];
    const GemvInput* ins[n + 1];
    void* ys[n + 1];
    for (int64_t s = 0; s < n; s++) {
        const int64_t e = w ? r->expert[s] : s;
        ls[s] = down ? &m->down[e] : &m->gate_up[e];
        ins[s] = down ? &bf->in_dn[s] : &bf->in_gu[s];
        ys[s] = down ? bf->dn + s * B * t->s->D * t->es : bf->gu + s * B * 2 * m->inter * t->es;
    }
    if (shared) ls[n] = &h->L->down, ins[n] = &bf->in_h, ys[n] = bf->shared;
    return products(w, t, (int)(n + shared), ls, ins, ys, items, own);
}

/* The MLP for the normed rows (in_x) -> a: dense (gate, up, dense_down_in, down), or the mixture
 * (router with the shared expert's score, gate and up; moe_route; the experts' gate_up;
 * moe_down_in; their down with the shared expert's; moe_combine). Without w: counted, as attention. */
static int mlp(Walker* w, const Here* h, int64_t* items, int64_t* own) {
    const Step* t = h->t;
    Buffers* b = t->b;
    const QvlLayer* L = h->L;
    const QvlLinear* ls[4];
    const int n = mlp_linears(L, ls);
    void* ys[4] = {L->moe.experts ? b->logits : b->g, L->moe.experts ? b->score : b->u, b->g, b->u};
    const QvlLinear* down = &L->down;
    if (!w) {
        products_of(NULL, t, n, ls, &b->in_x, ys, items, own);
        if (!L->moe.experts) return products_of(NULL, t, 1, &down, &b->in_h, (void* const*)&b->a, items, own);
        experts(NULL, h, 0, items, own);
        return experts(NULL, h, 1, items, own);
    }
    int status = products_of(w, t, n, ls, &b->in_x, ys, NULL, NULL);
    if (!L->moe.experts) {
        if (!status) status = team_serial(w, dense_down_in, h);
        if (!status) status = products_of(w, t, 1, &down, &b->in_h, (void* const*)&b->a, NULL, NULL);
        return status;
    }
    if (!status) status = team_serial(w, moe_route, h);
    if (!status) status = experts(w, h, 0, NULL, NULL);
    if (!status) status = team_serial(w, moe_down_in, h);
    if (!status) status = experts(w, h, 1, NULL, NULL);
    if (!status) status = team_serial(w, moe_combine, h);
    return status;
}

/* Every layer in order (what each thread of the team runs); without w, the jobs counted: the
 * most items of any (*items) and floats of any own result (*own). */
static int walk_layers(Walker* w, const void* ctx, int64_t* items, int64_t* own) {
    const Step* t = (const Step*)ctx;
    Here h = {t, NULL, 0, 0, 0};
    int status = 0;
    for (int64_t l = 0; l < t->n_layers && !status; l++) {
        h.L = t->layers + l, h.layer = l;
        const int delta = h.L->delta.out.n != 0;
        if (w) status = team_serial(w, mixer_in, &h);
        if (!status) status = delta ? delta_layer(w, &h, items, own) : attention(w, &h, items, own);
        if (!status && w) status = team_serial(w, mlp_in, &h);
        if (!status) status = mlp(w, &h, items, own);
        h.delta += delta, h.attention += !delta;
    }
    return status || !w ? status : team_serial(w, finish, &h);
}

static int program(Walker* w, const void* ctx) { return walk_layers(w, ctx, NULL, NULL); }

/* ---- the buffers and the checks before anything is written ---- */

/* `bytes` (rounded up to 64) at offset *at of base (NULL: nothing laid out, only counted). */
static char* carve(char* base, int64_t* at, int64_t bytes) {
    char* p = base ? base + *at : NULL;
    *at += (bytes + 63) / 64 * 64;
    return p;
}

/* The buffers laid out in base (64-byte aligned; NULL: only sized); returns the bytes they take. */
static int64_t lay_out(Step* t, char* base) {
    const QvlShape* s = t->s;
    const size_t es = t->es;
    const int64_t B = t->B, D = s->D, S = t->S, qn = B * s->H * s->hd, kn = B * s->Hkv * s->hd;
    const int64_t C = 2 * s->Hk * s->Dk + s->Hv * s->Dv, VD = s->Hv * s->Dv;
    int64_t E = 0, inter = 0, attention = 0, at = 0;
    for (int64_t l = 0; l < t->n_layers; l++) {
        const QvlMoe* m = &t->layers[l].moe;
        E = m->experts > E ? m->experts : E, inter = m->inter > inter ? m->inter : inter;
        attention |= !t->layers[l].delta.out.n;
    }
#define CARVE(bytes) carve(base, &at, bytes)
    Buffers* b = t->b;
    b->xn = CARVE(B * D * es), b->a = CARVE(B * D * es);
    b->q = CARVE(qn * es), b->att = CARVE(qn * es), b->k = CARVE(kn * es), b->v = CARVE(kn * es);
    b->qg = CARVE(s->gated ? 2 * qn * es : 0);
    b->g = CARVE(B * t->I * es), b->u = CARVE(B * t->I * es);
    b->mixed = CARVE(B * C * es), b->y = CARVE(B * C * es);
    b->z = CARVE(B * VD * es), b->o = CARVE(B * VD * es);
    b->bl = CARVE(B * s->Hv * es), b->al = CARVE(B * s->Hv * es);
    b->dg = (float*)CARVE(B * s->Hv * 4), b->beta = (float*)CARVE(B * s->Hv * 4);
    b->logits = CARVE(B * E * es), b->score = CARVE(B * es), b->shared = CARVE(E ? B * D * es : 0);
    b->gu = CARVE(S * B * 2 * inter * es), b->dn = CARVE(S * B * D * es);
    b->rows = CARVE(E ? B * (D > inter ? D : inter) * es : 0);
    GemvInput* ins[4] = {&b->in_x, &b->in_att, &b->in_h, &b->in_delta};
    const int64_t widths[4] = {D, attention ? s->H * s->hd : 0, t->I, VD};
    for (int i = 0; i < 4; i++) {
        char* mem = CARVE(widths[i] ? qvl_gemv_input_bytes(B, widths[i]) : 0);
        if (base && widths[i]) qvl_gemv_input(ins[i], B, widths[i], mem);
    }
    b->in_gu = (GemvInput*)CARVE(S * (int64_t)sizeof(GemvInput));
    b->in_dn = (GemvInput*)CARVE(S * (int64_t)sizeof(GemvInput));
    for (int64_t i = 0; i < S; i++) {
        char *gu = CARVE(qvl_gemv_input_bytes(B, D)), *dn = CARVE(qvl_gemv_input_bytes(B, inter));
        if (base) qvl_gemv_input(&b->in_gu[i], B, D, gu), qvl_gemv_input(&b->in_dn[i], B, inter, dn);
    }
    b->routing = (Routing*)CARVE(E ? t->n_layers * (int64_t)sizeof(Routing) : 0);
    for (int64_t l = 0; E && l < t->n_layers; l++) {
        int64_t* ints = (int64_t*)CARVE((2 * S + 2 * S * B) * 8);
        float* weight = (float*)CARVE(B * t->layers[l].moe.top_k * 4);
        if (base) b->routing[l] = (Routing){0, ints, ints + S, ints + 2 * S, ints + 2 * S + S * B, weight};
    }
#undef CARVE
    return at;
}

/* Whether the kernels take the shapes: the decode attention's head size and grouping, a
 * rotary part of even size, the delta rule's heads (Dk, Dv multiples of 16 up to 256). */
static int shapes_fit(const QvlShape* s, int64_t block) {
    if (s->hd % 32 != 0 || s->hd > 256 || s->Hkv < 1 || s->H % s->Hkv != 0 || s->H / s->Hkv > 16 || block < 1)
        return 0;
    if (s->rotary_dim < 2 || s->rotary_dim > s->hd || s->rotary_dim % 2) return 0;
    return !s->Hv || (s->Hk >= 1 && s->Hv % s->Hk == 0 && s->Dk % 16 == 0 && s->Dv % 16 == 0 &&
                      s->Dk <= 256 && s->Dv <= 256 && s->K >= 2 && s->K <= 8);
}

/* Whether the int4 linears reading each input share their group size (the input's codes' sums
 * are per group), and a mixture's experts share theirs. */
static int groups_fit(const QvlLayer* layers, int64_t n_layers, int64_t B) {
    for (int64_t l = 0; l < n_layers; l++) {
        const QvlLayer* L = layers + l;
        const QvlLinear* ls[4];
        int64_t gs;
        if (forms_of(ls, mixer_linears(L, ls), B, &gs), gs < 0) return 0;
        if (forms_of(ls, mlp_linears(L, ls), B, &gs), gs < 0) return 0;
        for (int64_t e = 1; e < L->moe.experts; e++)
            if (L->moe.gate_up[e].group_size != L->moe.gate_up[0].group_size ||
                L->moe.down[e].group_size != L->moe.down[0].group_size)
                return 0;
    }
    return 1;
}

/* One decode step (one new token per row) through all decoder layers, in place on the
 * hidden states x [B][D] of dtype dt (bf16 or float32; weights' scales, norms, cos/sin, the
 * cache and the convolution states share it): per layer RMSNorm, the token mixer, residual,
 * RMSNorm, the MLP (dense, or a mixture of experts with its shared expert), residual. The
 * mixer is attention (`attention`: RoPE with cos/sin [B][rotary_dim]; the new keys/values of
 * batch row b written at its position slots[b] of the paged cache: layer l (among the attention
 * layers), position j of row b, head h at l*layer_stride + table[b*table_stride + j/block] *
 * block_stride + h*head_stride + (j%block)*hd elements; row b attends to its positions
 * 0..slots[b]) or a Gated DeltaNet (`delta_layer`, on the rows' states). The threads run every
 * layer as one team (team.h), which takes over the products and attention of a thread that has
 * stopped. Returns 0, -1 when out of memory, -2 for shapes the kernels do not take (before
 * anything is written). */
int qvl_decode_layers(const QvlLayer* layers, int64_t n_layers, const QvlShape* s, void* x, int dt, int64_t B,
                      const void* cos, const void* sin, void* keys, void* values, int64_t layer_stride,
                      const int64_t* table, int64_t table_stride, int64_t block, int64_t block_stride,
                      int64_t head_stride, const int64_t* slots, const QvlStates* states, int threads) {
    if (!shapes_fit(s, block) || !groups_fit(layers, n_layers, B)) return -2;
    int64_t S = 0, I = 0;
    for (int64_t l = 0; l < n_layers; l++) {
        const QvlMoe* m = &layers[l].moe;
        const int64_t chosen = B * m->top_k < m->experts ? B * m->top_k : m->experts;
        S = chosen > S ? chosen : S, I = layers[l].gate.n > I ? layers[l].gate.n : I;
    }
    int64_t* lengths = malloc((size_t)B * sizeof(int64_t));
    if (!lengths) return -1;
    for (int64_t b = 0; b < B; b++) lengths[b] = slots[b] + 1;
    Buffers buffers;
    Step t = {layers, n_layers, s, dt, threads < 1 ? 1 : threads, B, S, I, dt == BF16 ? 2 : 4, (char*)x, cos, sin,
              keys, values, layer_stride, table_stride, block, block_stride, head_stride, table, slots, lengths,
              states, &buffers};
    char* base = aligned_alloc(64, (size_t)lay_out(&t, NULL));
    if (!base) {
        free(lengths);
        return -1;
    }
    lay_out(&t, base);
    int64_t items = 0, own = 0;
    walk_layers(NULL, &t, &items, &own);
    const int status = team_region(t.threads, items, own, program, &t, NULL);
    free(base), free(lengths);
    return status;
}
