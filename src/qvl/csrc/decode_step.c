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

/* One decode step (one new token per row) through all decoder layers, in place on the
 * hidden states x [B][D] of dtype dt (bf16 or float32; weights' scales, norms, cos/sin and
 * the cache share it): per layer RMSNorm, q/k/v, per-head q/k norms, RoPE (cos/sin [B][hd]),
 * the new keys/values of batch row b written at its position slots[b] of the paged cache
 * (layer l, position j of row b, head h at l*layer_stride + table[b*table_stride + j/block] *
 * block_stride + h*head_stride + (j%block)*hd elements), attention of row b over its
 * positions 0..slots[b], o_proj + residual,
 * RMSNorm, SwiGLU MLP (or the layer's mixture of experts) + residual. Returns 0, -1 when out of memory, -2 for shapes the decode attention does
 * not take (before anything is written). */
int qvl_decode_layers(const QvlLayer* layers, int64_t n_layers, void* x, int dt, int64_t B, int64_t D, int64_t H,
                      int64_t Hkv, int64_t hd, int64_t I, float eps, const void* cos, const void* sin, void* keys,
                      void* values, int64_t layer_stride, const int64_t* table, int64_t table_stride, int64_t block,
                      int64_t block_stride, int64_t head_stride, const int64_t* slots, int threads) {
    if (hd % 32 != 0 || hd > 256 || Hkv < 1 || H % Hkv != 0 || H / Hkv > 16 || block < 1) return -2;
    const size_t es = dt == BF16 ? 2 : 4;
    const int64_t qn = B * H * hd, kn = B * Hkv * hd;
    int64_t* lengths = malloc((size_t)B * sizeof(int64_t));
    char* buf = malloc((size_t)(2 * B * D + 2 * qn + 2 * kn + 2 * B * I) * es);
    if (!buf || !lengths) {
        free(buf), free(lengths);
        return -1;
    }
    for (int64_t b = 0; b < B; b++) lengths[b] = slots[b] + 1;
    char *xn = buf, *a = xn + B * D * es, *q = a + B * D * es, *att = q + qn * es, *k = att + qn * es,
         *v = k + kn * es, *g = v + kn * es, *u = g + B * I * es;
    int status = 0;
    for (int64_t l = 0; l < n_layers && status == 0; l++) {
        const QvlLayer* L = layers + l;
        char *kc = (char*)keys + l * layer_stride * es, *vc = (char*)values + l * layer_stride * es;
        qvl_rmsnorm(x, L->input_norm, xn, dt, B, D, eps, threads);
        if (layer_linear(&L->q, xn, dt, B, q, threads) || layer_linear(&L->k, xn, dt, B, k, threads) ||
            layer_linear(&L->v, xn, dt, B, v, threads)) {
            status = -1;
            break;
        }
        qvl_rmsnorm(q, L->q_norm, q, dt, B * H, hd, eps, threads);
        qvl_rmsnorm(k, L->k_norm, k, dt, B * Hkv, hd, eps, threads);
        for (int64_t b = 0; b < B; b++) {
            qvl_text_rope_rows(q + b * H * hd * es, dt, H, hd, (const char*)cos + b * hd * es,
                               (const char*)sin + b * hd * es);
            qvl_text_rope_rows(k + b * Hkv * hd * es, dt, Hkv, hd, (const char*)cos + b * hd * es,
                      (const char*)sin + b * hd * es);
            for (int64_t h = 0; h < Hkv; h++) {
                int64_t at = (table[b * table_stride + slots[b] / block] * block_stride + h * head_stride +
                              slots[b] % block * hd) * es;
                memcpy(kc + at, k + (b * Hkv + h) * hd * es, (size_t)hd * es);
                memcpy(vc + at, v + (b * Hkv + h) * hd * es, (size_t)hd * es);
            }
        }
        status = qvl_decode_attention(q, kc, vc, dt, table, table_stride, block, block_stride, head_stride, B, H, Hkv,
                                      lengths, hd, att, threads);
        if (status || layer_linear(&L->o, att, dt, B, a, threads)) {
            status = status ? status : -1;
            break;
        }
        add_into(x, a, dt, B * D);
        qvl_rmsnorm(x, L->post_norm, xn, dt, B, D, eps, threads);
        if (L->moe.experts) {
            if (moe_mlp(&L->moe, xn, dt, B, D, a, threads)) {
                status = -1;
                break;
            }
            add_into(x, a, dt, B * D);
            continue;
        }
        if (layer_linear(&L->gate, xn, dt, B, g, threads) || layer_linear(&L->up, xn, dt, B, u, threads)) {
            status = -1;
            break;
        }
        qvl_silu_mul(g, u, dt, B * I, threads);
        if (layer_linear(&L->down, g, dt, B, a, threads)) {
            status = -1;
            break;
        }
        add_into(x, a, dt, B * D);
    }
    free(buf);
    free(lengths);
    return status;
}
