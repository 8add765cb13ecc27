/* Gated DeltaNet's kernels (csrc/delta_rule.c) against the delta rule token by token in plain C,
 * as a standalone program: tests/test_delta_rule.py cross-compiles it with the kernel sources
 * for aarch64 and runs it under qemu-user, where Python and torch are not available. Prints one
 * line per failed check and exits 1 when any fails. */
#include <stdio.h>

#include "common.h"

int qvl_gated_delta_rule(const void* q, const void* k, const void* v, int dt, int64_t T, int64_t Hk, int64_t Hv,
                         int64_t Dk, int64_t Dv, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                         int64_t v_tok, int64_t v_head, const float* g, const float* beta, float* state, void* out,
                         int64_t offset, int64_t chunk, int threads);
int qvl_gated_delta_step(const void* q, const void* k, const void* v, int dt, int64_t B, int64_t Hk, int64_t Hv,
                         int64_t Dk, int64_t Dv, int64_t q_tok, int64_t q_head, int64_t k_tok, int64_t k_head,
                         int64_t v_tok, int64_t v_head, const float* g, const float* beta, float* states,
                         const int64_t* slots, void* out, int threads);
int qvl_causal_conv(const void* x, int dt, int64_t T, int64_t C, int64_t x_tok, const void* w, int64_t K, void* state,
                    void* out, int threads);
int qvl_causal_conv_step(const void* x, int dt, int64_t B, int64_t C, int64_t x_tok, const void* w, int64_t K,
                         void* states, const int64_t* slots, void* out, int threads);

enum { T = 100, HK = 2, HV = 4, D = 32, CH = 40, K = 4, CHUNK_SIZE = 32 };
static int failures = 0;
static uint32_t seed = 777;

static float frand(void) { /* uniform in [-1, 1) */
    seed = seed * 1664525u + 1013904223u;
    return (float)(seed >> 8) / 8388608.f - 1.f;
}

static void check(const char* what, const float* out, const float* ref, int64_t n, float tol) {
    float worst = 0.f;
    for (int64_t i = 0; i < n; i++) {
        const float e = fabsf(out[i] - ref[i]);
        worst = e > worst ? e : worst;
    }
    if (!(worst <= tol)) {
        printf("FAIL %s: max error %g\n", what, worst);
        failures++;
    }
}

static void normalised(const float* x, float scale, float* y) {
    float ss = 0.f;
    for (int d = 0; d < D; d++) ss += x[d] * x[d];
    for (int d = 0; d < D; d++) y[d] = x[d] / sqrtf(ss + 1e-6f) * scale;
}

/* The rule for tokens [t0, t1) on state S [HV][D][D]: out [T][HV][D]. */
static void recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta, int t0,
                      int t1, float* S, float* out) {
    for (int t = t0; t < t1; t++)
        for (int h = 0; h < HV; h++) {
            float qn[D], kn[D], u[D];
            float* s = S + h * D * D;
            normalised(q + (t * HK + h / (HV / HK)) * D, 1.f / sqrtf((float)D), qn);
            normalised(k + (t * HK + h / (HV / HK)) * D, 1.f, kn);
            for (int i = 0; i < D * D; i++) s[i] *= expf(g[t * HV + h]);
            for (int c = 0; c < D; c++) {
                float kv = 0.f;
                for (int d = 0; d < D; d++) kv += s[d * D + c] * kn[d];
                u[c] = beta[t * HV + h] * (v[(t * HV + h) * D + c] - kv);
            }
            for (int d = 0; d < D; d++)
                for (int c = 0; c < D; c++) s[d * D + c] += kn[d] * u[c];
            for (int c = 0; c < D; c++) {
                float o = 0.f;
                for (int d = 0; d < D; d++) o += s[d * D + c] * qn[d];
                out[(t * HV + h) * D + c] = o;
            }
        }
}

static int call_rule(const float* q, const float* k, const float* v, const float* g, const float* beta, int t0,
                     int t1, float* S, float* out) {
    return qvl_gated_delta_rule(q + t0 * HK * D, k + t0 * HK * D, v + t0 * HV * D, F32, t1 - t0, HK, HV, D, D, HK * D,
                                D, HK * D, D, HV * D, D, g + t0 * HV, beta + t0 * HV, S, out + t0 * HV * D, t0,
                                CHUNK_SIZE, 2);
}

static void test_delta_rule(void) {
    static float q[T * HK * D], k[T * HK * D], v[T * HV * D], g[T * HV], beta[T * HV];
    static float S[HV * D * D], S2[HV * D * D], R[HV * D * D], out[T * HV * D], out2[T * HV * D], ref[T * HV * D];
    for (int i = 0; i < T * HK * D; i++) q[i] = frand(), k[i] = frand();
    for (int i = 0; i < T * HV * D; i++) v[i] = frand();
    for (int i = 0; i < T * HV; i++) g[i] = -0.3f * (frand() + 1.f), beta[i] = 0.5f * (frand() + 1.f);
    for (int i = 0; i < HV * D * D; i++) S[i] = S2[i] = R[i] = 0.1f * frand();
    recurrent(q, k, v, g, beta, 0, T, R, ref);
    if (call_rule(q, k, v, g, beta, 0, T, S, out) != 0) printf("FAIL delta rule declined\n"), failures++;
    check("delta rule output", out, ref, T * HV * D, 1e-4f);
    check("delta rule state", S, R, HV * D * D, 1e-4f);
    /* slices ending at a multiple of the chunk: the same bits */
    call_rule(q, k, v, g, beta, 0, 2 * CHUNK_SIZE, S2, out2);
    call_rule(q, k, v, g, beta, 2 * CHUNK_SIZE, T, S2, out2);
    if (memcmp(out, out2, sizeof out) || memcmp(S, S2, sizeof S)) printf("FAIL delta rule slices differ\n"), failures++;
    /* one decode step of rows 0 and 1 on slots 1 and 0 of a pool, against the rule for token T-1 */
    static float pool[2 * HV * D * D], step[2 * HV * D], g2[2 * HV], beta2[2 * HV];
    memcpy(pool, R, sizeof R), memcpy(pool + HV * D * D, R, sizeof R);
    for (int i = 0; i < 2 * HV; i++) g2[i] = g[(T - 1) * HV + i % HV], beta2[i] = beta[(T - 1) * HV + i % HV];
    const int64_t slots[2] = {1, 0};
    recurrent(q, k, v, g, beta, T - 1, T, R, ref);
    qvl_gated_delta_step(q + (T - 1) * HK * D, k + (T - 1) * HK * D, v + (T - 1) * HV * D, F32, 2, HK, HV, D, D, 0, D,
                         0, D, 0, D, g2, beta2, pool, slots, step, 2);
    check("delta step output", step, ref + (T - 1) * HV * D, HV * D, 1e-4f);
    check("delta step other row", step + HV * D, ref + (T - 1) * HV * D, HV * D, 1e-4f);
    check("delta step state", pool, R, HV * D * D, 1e-4f);
}

static float silu(float s) { return s / (1.f + expf(-s)); }

static void test_conv(void) {
    static float x[T * CH], w[CH * K], state[CH * (K - 1)], out[T * CH], ref[T * CH], pool[2 * CH * (K - 1)];
    for (int i = 0; i < T * CH; i++) x[i] = frand();
    for (int i = 0; i < CH * K; i++) w[i] = frand();
    for (int i = 0; i < CH * (K - 1); i++) state[i] = frand();
    for (int t = 0; t < T; t++)
        for (int c = 0; c < CH; c++) {
            float s = 0.f;
            for (int j = 0; j < K; j++) {
                const int at = t - K + 1 + j;
                s += w[c * K + j] * (at >= 0 ? x[at * CH + c] : state[c * (K - 1) + K - 1 + at]);
            }
            ref[t * CH + c] = silu(s);
        }
    memcpy(pool + CH * (K - 1), state, sizeof state);
    qvl_causal_conv(x, F32, T - 1, CH, CH, w, K, state, out, 2);
    const int64_t slot = 1;
    qvl_causal_conv_step(x + (T - 1) * CH, F32, 1, CH, CH, w, K, state, &(int64_t){0}, out + (T - 1) * CH, 1);
    check("causal conv", out, ref, T * CH, 1e-5f);
    qvl_causal_conv(x, F32, T, CH, CH, w, K, pool + slot * CH * (K - 1), out, 2);
    check("causal conv state", pool + slot * CH * (K - 1), state, CH * (K - 1), 0.f);
}

int main(void) {
    test_delta_rule();
    test_conv();
    printf("%s\n", failures ? "delta rule checks failed" : "delta rule checked");
    return failures ? 1 : 0;
}
