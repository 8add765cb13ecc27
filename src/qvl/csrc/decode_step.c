/* A whole decode step through every decoder layer in one call (qvl_decode_layers), in bf16 or
 * float32, with the same kernels and roundings as the per-layer modules; and qvl_features, what
 * this build has. */
#include "common.h"

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

static int layer_linear(const QvlLinear* l, const void* x, int dt, int64_t M, void* y, int threads) {
    return qvl_linear((int)l->kind, x, dt, M, l->k, l->n, l->w, l->scale, l->zero, l->group_size, l->bias, y, threads);
}

/* The experts' MLP of B rows (xn [B][D], normed) -> out [B][D], as qvl.model.text.SparseMoE
 * computes it: router logits in dt, softmax in float32, the top_k experts (ties to the lower
 * index) with their probabilities renormalised over the k and rounded to dt; each chosen expert
 * once for the rows that chose it, in ascending expert order: silu(gate) * up, down, times the
 * row's weight (rounded), added into the row's output (rounded at each add). Returns 0, or -1
 * when out of memory. */
static int moe_mlp(const QvlMoe* m, const void* xn, int dt, int64_t B, int64_t D, void* out, int threads) {
    const size_t es = dt == BF16 ? 2 : 4;
    const int64_t E = m->experts, K = m->top_k, I = m->inter;
    char* logits = malloc((size_t)(B * E) * es);
    char* rows_x = malloc((size_t)(B * D) * es);
    char* gu = malloc((size_t)(B * 2 * I) * es);
    char* h = malloc((size_t)(B * I) * es);
    char* dn = malloc((size_t)(B * D) * es);
    int64_t* chosen = malloc((size_t)(B * K) * sizeof(int64_t));
    float* prob = malloc((size_t)E * sizeof(float));
    float* weight = malloc((size_t)(B * K) * sizeof(float));
    int64_t* members = malloc((size_t)B * sizeof(int64_t));
    int64_t* slot = malloc((size_t)B * sizeof(int64_t));
    int status = !logits || !rows_x || !gu || !h || !dn || !chosen || !prob || !weight || !members || !slot ? -1 : 0;
    if (!status) status = layer_linear(&m->router, xn, dt, B, logits, threads);
    for (int64_t b = 0; b < B && !status; b++) {
        float top = -INFINITY, total = 0.f, kept = 0.f;
        for (int64_t e = 0; e < E; e++) top = fmaxf(top, get(logits, dt, b * E + e));
        for (int64_t e = 0; e < E; e++) total += prob[e] = expf(get(logits, dt, b * E + e) - top);
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
            float w = prob[chosen[b * K + j]] / kept;
            weight[b * K + j] = dt == BF16 ? round_bf(w) : w;
        }
    }
    if (!status) memset(out, 0, (size_t)(B * D) * es);
    for (int64_t e = 0; e < E && !status; e++) {
        int64_t n = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < K; j++)
                if (chosen[b * K + j] == e) members[n] = b, slot[n++] = j;
        if (!n) continue;
        for (int64_t r = 0; r < n; r++) memcpy(rows_x + r * D * es, (const char*)xn + members[r] * D * es, (size_t)D * es);
        if (layer_linear(&m->gate_up[e], rows_x, dt, n, gu, threads)) {
            status = -1;
            break;
        }
        for (int64_t r = 0; r < n; r++) {
            qvl_silu_mul(gu + r * 2 * I * es, gu + (r * 2 * I + I) * es, dt, I, 1);
            memcpy(h + r * I * es, gu + r * 2 * I * es, (size_t)I * es);
        }
        if (layer_linear(&m->down[e], h, dt, n, dn, threads)) {
            status = -1;
            break;
        }
        for (int64_t r = 0; r < n; r++) {
            const float w = weight[members[r] * K + slot[r]];
            for (int64_t i = 0; i < D; i++) {
                float c = get(dn, dt, r * D + i) * w, o = get(out, dt, members[r] * D + i);
                put(out, dt, members[r] * D + i, (dt == BF16 ? round_bf(c) : c) + o);
            }
        }
    }
    free(logits), free(rows_x), free(gu), free(h), free(dn), free(chosen), free(prob), free(weight), free(members),
        free(slot);
    return status;
}

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

/* What every layer of one step shares: the model's shapes, the rows, their cache and states. */
typedef struct {
    const QvlShape* s;
    int dt, threads;
    int64_t B;
    size_t es;
    const char *cos, *sin; /* [B][rotary_dim] */
    char *keys, *values;
    int64_t layer_stride, table_stride, block, block_stride, head_stride;
    const int64_t *table, *slots, *lengths;
    const QvlStates* states;
} Step;

/* RMSNorm of `rows` rows of `dim` (out may be x): qvl_rmsnorm, or qvl_rmsnorm_zero_centred (Qwen3.5). */
static void norm_rows(const Step* t, const void* x, const void* w, void* out, int64_t rows, int64_t dim) {
    (t->s->zero_centred ? qvl_rmsnorm_zero_centred : qvl_rmsnorm)(x, w, out, t->dt, rows, dim, t->s->eps, t->threads);
}

/* Attention of layer L (the `layer`-th with keys and values) for the normed rows xn [B][D] ->
 * out [B][D]: q/k/v, the q/k norms, RoPE on each head's first rotary_dim dims, the new keys and
 * values written at each row's position, attention over its positions 0..slots[b], times
 * sigmoid(gate) where q_proj gives each head's gate after its query (rounded as torch rounds
 * them), o_proj. w: scratch. Returns 0, -1 out of memory, or qvl_decode_attention's status. */
static int attention(const Step* t, const QvlLayer* L, int64_t layer, const char* xn, char* w, void* out) {
    const QvlShape* s = t->s;
    const int dt = t->dt;
    const size_t es = t->es;
    const int64_t B = t->B, H = s->H, Hkv = s->Hkv, hd = s->hd, rd = s->rotary_dim, qn = B * H * hd, kn = B * Hkv * hd;
    char *q = w, *att = q + qn * es, *k = att + qn * es, *v = k + kn * es, *qg = v + kn * es; /* qg [B][H][2 hd] */
    char *kc = t->keys + layer * t->layer_stride * es, *vc = t->values + layer * t->layer_stride * es;
    if (layer_linear(&L->q, xn, dt, B, s->gated ? qg : q, t->threads) || layer_linear(&L->k, xn, dt, B, k, t->threads) ||
        layer_linear(&L->v, xn, dt, B, v, t->threads))
        return -1;
    if (s->gated)
        for (int64_t r = 0; r < B * H; r++) memcpy(q + r * hd * es, qg + 2 * r * hd * es, (size_t)hd * es);
    norm_rows(t, q, L->q_norm, q, B * H, hd);
    norm_rows(t, k, L->k_norm, k, B * Hkv, hd);
    for (int64_t b = 0; b < B; b++) {
        const char *cos = t->cos + b * rd * es, *sin = t->sin + b * rd * es;
        for (int64_t h = 0; h < H; h++) qvl_text_rope_rows(q + (b * H + h) * hd * es, dt, 1, rd, cos, sin);
        for (int64_t h = 0; h < Hkv; h++) {
            qvl_text_rope_rows(k + (b * Hkv + h) * hd * es, dt, 1, rd, cos, sin);
            const int64_t at = (t->table[b * t->table_stride + t->slots[b] / t->block] * t->block_stride +
                                h * t->head_stride + t->slots[b] % t->block * hd) * es;
            memcpy(kc + at, k + (b * Hkv + h) * hd * es, (size_t)hd * es);
            memcpy(vc + at, v + (b * Hkv + h) * hd * es, (size_t)hd * es);
        }
    }
    int status = qvl_decode_attention(q, kc, vc, dt, t->table, t->table_stride, t->block, t->block_stride,
                                      t->head_stride, B, H, Hkv, t->lengths, hd, att, t->threads);
    if (status) return status;
    if (s->gated)
        for (int64_t r = 0; r < B * H; r++)
            for (int64_t i = 0; i < hd; i++) {
                const float gate = in_dt(sigmoid(get(qg, dt, (2 * r + 1) * hd + i)), dt);
                put(att, dt, r * hd + i, get(att, dt, r * hd + i) * gate);
            }
    return layer_linear(&L->o, att, dt, B, out, t->threads) ? -1 : 0;
}

/* A Gated DeltaNet layer (the `index`-th) for the normed rows xn [B][D] -> out [B][D], as
 * qvl.model.gated_deltanet computes a decode step: in_proj_qkv/z/b/a, beta = sigmoid(b) (rounded),
 * g = -e^A_log softplus(a + dt_bias) in float32, the convolution's and the delta rule's steps on
 * the rows' states, the gated RMSNorm per value head (float32 rms, times the weight after
 * rounding, times silu(z) in float32, rounded), out_proj. w, f: scratch. Returns 0, or -1. */
static int delta_layer(const Step* t, const QvlDelta* L, int64_t index, const char* xn, char* w, float* f, void* out) {
    const QvlShape* s = t->s;
    const int dt = t->dt;
    const size_t es = t->es;
    const int64_t B = t->B, Hv = s->Hv, Dv = s->Dv, C = 2 * s->Hk * s->Dk + Hv * Dv, VD = Hv * Dv;
    char *mixed = w, *y = mixed + B * C * es, *z = y + B * C * es, *o = z + B * VD * es, *bl = o + B * VD * es,
         *al = bl + B * Hv * es;
    float *g = f, *beta = f + B * Hv;
    if (layer_linear(&L->qkv, xn, dt, B, mixed, t->threads) || layer_linear(&L->z, xn, dt, B, z, t->threads) ||
        layer_linear(&L->b, xn, dt, B, bl, t->threads) || layer_linear(&L->a, xn, dt, B, al, t->threads))
        return -1;
    for (int64_t i = 0; i < B * Hv; i++) {
        const float a = get(al, dt, i) + get(L->dt_bias, dt, i % Hv);
        beta[i] = in_dt(sigmoid(get(bl, dt, i)), dt);
        g[i] = -expf(get(L->a_log, dt, i % Hv)) * (a > 20.f ? a : log1pf(expf(a)));
    }
    const QvlStates* st = t->states;
    const int64_t Hk = s->Hk, Dk = s->Dk;
    if (qvl_causal_conv_step(mixed, dt, B, C, C, L->conv, s->K, (char*)st->conv + index * st->slots * C * (s->K - 1) * es,
                             st->rows, y, t->threads) ||
        qvl_gated_delta_step(y, y + Hk * Dk * es, y + 2 * Hk * Dk * es, dt, B, Hk, Hv, Dk, Dv, C, Dk, C, Dk, C, Dv, g,
                             beta, st->recurrent + index * st->slots * Hv * Dk * Dv, st->rows, o, t->threads))
        return -2;
    qvl_gated_rmsnorm(o, z, L->norm, o, dt, B * Hv, Dv, s->eps, t->threads);
    return layer_linear(&L->out, o, dt, B, out, t->threads) ? -1 : 0;
}

/* The SwiGLU MLP of layer L's gate/up/down for the normed rows xn [B][D] -> out [B][D]. */
static int dense_mlp(const Step* t, const QvlLayer* L, const char* xn, char* w, void* out) {
    const int64_t B = t->B, I = L->gate.n;
    char *g = w, *u = w + B * I * t->es;
    if (layer_linear(&L->gate, xn, t->dt, B, g, t->threads) || layer_linear(&L->up, xn, t->dt, B, u, t->threads))
        return -1;
    qvl_silu_mul(g, u, t->dt, B * I, t->threads);
    return layer_linear(&L->down, g, t->dt, B, out, t->threads) ? -1 : 0;
}

/* Layer L's MLP for the normed rows xn [B][D] -> out [B][D]: dense, or the mixture of experts
 * plus, where it has one, sigmoid(shared_gate xn) times the shared expert (each step rounded as
 * torch rounds it). */
static int mlp(const Step* t, const QvlLayer* L, const char* xn, char* w, void* out) {
    const QvlMoe* m = &L->moe;
    const int dt = t->dt;
    const int64_t B = t->B, D = t->s->D;
    if (!m->experts) return dense_mlp(t, L, xn, w, out);
    if (moe_mlp(m, xn, dt, B, D, out, t->threads)) return -1;
    if (!m->shared_gate.n) return 0;
    char *score = w, *shared = score + B * t->es;
    if (layer_linear(&m->shared_gate, xn, dt, B, score, t->threads) ||
        dense_mlp(t, L, xn, shared + B * D * t->es, shared))
        return -1;
    for (int64_t b = 0; b < B; b++) {
        const float weight = in_dt(sigmoid(get(score, dt, b)), dt);
        for (int64_t i = 0; i < D; i++)
            put(out, dt, b * D + i, get(out, dt, b * D + i) + in_dt(weight * get(shared, dt, b * D + i), dt));
    }
    return 0;
}

/* Scratch elements (of the compute dtype) the layers need beside the hidden rows. */
static int64_t scratch(const QvlLayer* layers, int64_t n_layers, const QvlShape* s, int64_t B) {
    const int64_t qn = B * s->H * s->hd, kn = B * s->Hkv * s->hd, C = 2 * s->Hk * s->Dk + s->Hv * s->Dv;
    const int64_t delta = 2 * B * C + 2 * B * s->Hv * s->Dv + 2 * B * s->Hv;
    int64_t most = 2 * qn + 2 * kn + (s->gated ? 2 * qn : 0);
    most = delta > most ? delta : most;
    for (int64_t l = 0; l < n_layers; l++) {
        const int64_t need = B + B * s->D + 2 * B * layers[l].gate.n;
        most = need > most ? need : most;
    }
    return most;
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

/* One decode step (one new token per row) through all decoder layers, in place on the
 * hidden states x [B][D] of dtype dt (bf16 or float32; weights' scales, norms, cos/sin, the
 * cache and the convolution states share it): per layer RMSNorm, the token mixer, residual,
 * RMSNorm, the MLP (dense, or a mixture of experts with its shared expert), residual. The
 * mixer is attention (`attention`: RoPE with cos/sin [B][rotary_dim]; the new keys/values of
 * batch row b written at its position slots[b] of the paged cache: layer l (among the attention
 * layers), position j of row b, head h at l*layer_stride + table[b*table_stride + j/block] *
 * block_stride + h*head_stride + (j%block)*hd elements; row b attends to its positions
 * 0..slots[b]) or a Gated DeltaNet (`delta_layer`, on the rows' states). Returns 0, -1 when out
 * of memory, -2 for shapes the kernels do not take (before anything is written). */
int qvl_decode_layers(const QvlLayer* layers, int64_t n_layers, const QvlShape* s, void* x, int dt, int64_t B,
                      const void* cos, const void* sin, void* keys, void* values, int64_t layer_stride,
                      const int64_t* table, int64_t table_stride, int64_t block, int64_t block_stride,
                      int64_t head_stride, const int64_t* slots, const QvlStates* states, int threads) {
    if (!shapes_fit(s, block)) return -2;
    const size_t es = dt == BF16 ? 2 : 4;
    const int64_t D = s->D;
    int64_t* lengths = malloc((size_t)B * sizeof(int64_t));
    char* buf = malloc((size_t)(2 * B * D + scratch(layers, n_layers, s, B)) * es);
    float* f = malloc((size_t)(2 * B * (s->Hv ? s->Hv : 1)) * sizeof(float));
    if (!buf || !lengths || !f) {
        free(buf), free(lengths), free(f);
        return -1;
    }
    for (int64_t b = 0; b < B; b++) lengths[b] = slots[b] + 1;
    const Step t = {s, dt, threads, B, es, cos, sin, keys, values, layer_stride, table_stride, block, block_stride,
                    head_stride, table, slots, lengths, states};
    char *xn = buf, *a = xn + B * D * es, *w = a + B * D * es;
    int status = 0;
    for (int64_t l = 0, attention_layer = 0, delta_index = 0; l < n_layers && status == 0; l++) {
        const QvlLayer* L = layers + l;
        norm_rows(&t, x, L->input_norm, xn, B, D);
        status = L->delta.out.n ? delta_layer(&t, &L->delta, delta_index++, xn, w, f, a)
                                : attention(&t, L, attention_layer++, xn, w, a);
        if (status) break;
        add_into(x, a, dt, B * D);
        norm_rows(&t, x, L->post_norm, xn, B, D);
        if ((status = mlp(&t, L, xn, w, a))) break;
        add_into(x, a, dt, B * D);
    }
    free(buf), free(lengths), free(f);
    return status;
}
