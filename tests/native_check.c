/* The kernels against plain float references, as a standalone program: tests/test_tiers.py
 * cross-compiles it with the kernel sources for aarch64 and runs it under qemu-user, where
 * Python and torch are not available. Prints "features N", one line per failed check, and
 * exits 1 when any fails. */
#include <stdio.h>

#include "common.h"
#include "quantise.h"

static int failures = 0;
static uint32_t seed = 12345;

static float frand(void) { /* uniform in [-1, 1) */
    seed = seed * 1664525u + 1013904223u;
    return (float)(seed >> 8) / 8388608.f - 1.f;
}

static void check(const char* what, const float* out, const float* ref, int64_t n, float tol) {
    float worst = 0.f, top = 1e-6f;
    for (int64_t i = 0; i < n; i++) {
        float e = fabsf(out[i] - ref[i]);
        worst = e > worst ? e : worst;
        top = fabsf(ref[i]) > top ? fabsf(ref[i]) : top;
    }
    if (!(worst <= tol * top)) {
        printf("FAIL %s: max error %g of %g\n", what, worst, top);
        failures++;
    }
}

static void int8_weights(const float* w, int64_t N, int64_t K, int8_t* q, float* scale) {
    for (int64_t n = 0; n < N; n++) {
        float m = 1e-12f;
        for (int64_t k = 0; k < K; k++) m = fabsf(w[n * K + k]) > m ? fabsf(w[n * K + k]) : m;
        scale[n] = m / 127.f;
        for (int64_t k = 0; k < K; k++) q[n * K + k] = (int8_t)round_int(w[n * K + k] / scale[n]);
    }
}

static void test_linear(void) {
    enum { K = 512, N = 48 };
    static float w[N * K], x[5 * K], y[5 * N], ref[5 * N], deq[N * K], sc4[N * (K / 32)], zr4[N * (K / 32)];
    static int8_t q8[N * K];
    static uint8_t q4[N * K / 2];
    static float s8[N];
    static uint16_t wb[N * K];
    for (int i = 0; i < N * K; i++) w[i] = frand();
    for (int i = 0; i < 5 * K; i++) x[i] = frand();
    int8_weights(w, N, K, q8, s8);
    for (int m = 1; m <= 5; m++) {
        for (int n = 0; n < N; n++)
            for (int r = 0; r < m; r++) {
                double s = 0;
                for (int k = 0; k < K; k++) s += (double)q8[n * K + k] * s8[n] * x[r * K + k];
                ref[r * N + n] = (float)s;
            }
        qvl_linear(W_INT8, x, F32, m, K, N, q8, s8, NULL, 0, NULL, y, 2);
        check("int8 gemv", y, ref, m * N, 2e-4f);
    }
    for (int gs = 32; gs <= 256; gs *= 2) {
        const int G = K / gs;
        for (int n = 0; n < N; n++)
            for (int g = 0; g < G; g++) {
                float lo = 1e30f, hi = -1e30f;
                for (int k = g * gs; k < (g + 1) * gs; k++) {
                    lo = w[n * K + k] < lo ? w[n * K + k] : lo;
                    hi = w[n * K + k] > hi ? w[n * K + k] : hi;
                }
                float s = (hi - lo) / 15.f;
                sc4[n * G + g] = s, zr4[n * G + g] = lo + 8 * s;
                for (int k = g * gs; k < (g + 1) * gs; k++) {
                    int c = round_int((w[n * K + k] - lo) / s);
                    c = c < 0 ? 0 : c > 15 ? 15 : c;
                    if (k % 2 == 0)
                        q4[(n * K + k) / 2] = (uint8_t)c;
                    else
                        q4[(n * K + k) / 2] |= (uint8_t)(c << 4);
                    deq[n * K + k] = (c - 8) * s + zr4[n * G + g];
                }
            }
        for (int m = 1; m <= 5; m += 2) {
            for (int n = 0; n < N; n++)
                for (int r = 0; r < m; r++) {
                    double s = 0;
                    for (int k = 0; k < K; k++) s += (double)deq[n * K + k] * x[r * K + k];
                    ref[r * N + n] = (float)s;
                }
            qvl_linear(W_INT4, x, F32, m, K, N, q4, sc4, zr4, gs, NULL, y, 2);
            check("int4 gemv", y, ref, m * N, 3e-2f);
        }
        static float back[N * K];
        qvl_dequantize(W_INT4, q4, sc4, zr4, gs, N, K, F32, back, 2);
        check("int4 dequantize", back, deq, N * K, 1e-5f);
    }
    for (int i = 0; i < N * K; i++) wb[i] = f32_to_bf16(w[i]);
    for (int m = 1; m <= 4; m++) {
        for (int n = 0; n < N; n++)
            for (int r = 0; r < m; r++) {
                double s = 0;
                for (int k = 0; k < K; k++) s += (double)bf16_to_f32(wb[n * K + k]) * x[r * K + k];
                ref[r * N + n] = (float)s;
            }
        qvl_linear(W_BF16, x, F32, m, K, N, wb, NULL, NULL, 0, NULL, y, 2);
        check("bf16 gemv", y, ref, m * N, 1e-5f);
    }
}

static void reference_attention(const float* q, const float* keys, const float* values, int64_t H, int64_t Hkv,
                                int64_t L, int64_t cap, int64_t D, float* out) {
    float p[256];
    for (int64_t h = 0; h < H; h++) {
        const float* kh = keys + (h / (H / Hkv)) * cap * D;
        const float* vh = values + (h / (H / Hkv)) * cap * D;
        double top = -1e30, sum = 0;
        for (int64_t j = 0; j < L; j++) {
            double s = 0;
            for (int64_t d = 0; d < D; d++) s += (double)q[h * D + d] * kh[j * D + d];
            p[j] = (float)(s / sqrt((double)D));
            if (p[j] > top) top = p[j];
        }
        for (int64_t j = 0; j < L; j++) sum += p[j] = (float)exp(p[j] - top);
        for (int64_t d = 0; d < D; d++) {
            double o = 0;
            for (int64_t j = 0; j < L; j++) o += p[j] / sum * vh[j * D + d];
            out[h * D + d] = (float)o;
        }
    }
}

static void test_decode_attention(void) {
    enum { H = 8, HKV = 2, D = 64, CAP = 40 };
    static float q[H * D], keys[HKV * CAP * D], values[HKV * CAP * D], out[H * D], ref[H * D];
    static uint16_t qb[H * D], kb[HKV * CAP * D], vb[HKV * CAP * D], ob[H * D];
    for (int i = 0; i < H * D; i++) qb[i] = f32_to_bf16(q[i] = frand() * 2);
    for (int i = 0; i < HKV * CAP * D; i++) {
        kb[i] = f32_to_bf16(keys[i] = frand() * 2);
        vb[i] = f32_to_bf16(values[i] = frand());
    }
    const int64_t table = 0; /* one block of CAP positions */
    for (int64_t L = 37; L > 0; L -= 18) { /* a row attends to its own first L positions */
        reference_attention(q, keys, values, H, HKV, (int)L, CAP, D, ref);
        qvl_decode_attention(q, keys, values, F32, &table, 1, CAP, HKV * CAP * D, CAP * D, 1, H, HKV, &L, D, out, 2);
        check("decode attention f32", out, ref, H * D, 1e-4f);
        float kf[HKV * CAP * D], vf[HKV * CAP * D], qf[H * D];
        for (int i = 0; i < HKV * CAP * D; i++) kf[i] = bf16_to_f32(kb[i]), vf[i] = bf16_to_f32(vb[i]);
        for (int i = 0; i < H * D; i++) qf[i] = bf16_to_f32(qb[i]);
        reference_attention(qf, kf, vf, H, HKV, (int)L, CAP, D, ref);
        qvl_decode_attention(qb, kb, vb, BF16, &table, 1, CAP, HKV * CAP * D, CAP * D, 1, H, HKV, &L, D, ob, 2);
        for (int i = 0; i < H * D; i++) out[i] = bf16_to_f32(ob[i]);
        check("decode attention bf16", out, ref, H * D, 2e-2f);
    }
}

/* A two-layer decode step in float32 with int8 weights against a float reference. */
enum { DD = 128, DH = 4, DKV = 2, DHD = 32, DI = 256, DCAP = 8, DPOS = 5, DL = 2 };
static float dw[DL][7][DI * DD], dscale[DL][7][DI];
static int8_t dq[DL][7][DI * DD];
static float dnorm[DL][4][DD];

static void ref_norm(const float* x, const float* w, float* out, int n) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float inv = (float)(1.0 / sqrt(ss / n + 1e-6));
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

static void ref_linear(int l, int which, const float* x, int n, int k, float* y) {
    for (int o = 0; o < n; o++) {
        double s = 0;
        for (int i = 0; i < k; i++) s += (double)dq[l][which][o * k + i] * dscale[l][which][o] * x[i];
        y[o] = (float)s;
    }
}

static void ref_rope(float* x, int heads, const float* cos, const float* sin) {
    for (int h = 0; h < heads; h++) {
        float t[DHD];
        memcpy(t, x + h * DHD, sizeof t);
        for (int i = 0; i < DHD; i++)
            x[h * DHD + i] = t[i] * cos[i] + (i < DHD / 2 ? -t[i + DHD / 2] : t[i - DHD / 2]) * sin[i];
    }
}

static void test_decode_layers(void) {
    static const int outs[7] = {DH * DHD, DKV * DHD, DKV * DHD, DD, DI, DI, DD};
    static const int ins[7] = {DD, DD, DD, DH * DHD, DD, DD, DI};
    static float keys[DL][DKV][DCAP][DHD], values[DL][DKV][DCAP][DHD], rk[DL][DKV][DCAP][DHD], rv[DL][DKV][DCAP][DHD];
    float x[DD], rx[DD], cos[DHD], sin[DHD];
    QvlLayer layers[DL];
    for (int l = 0; l < DL; l++) {
        for (int j = 0; j < 7; j++) {
            for (int i = 0; i < outs[j] * ins[j]; i++) dw[l][j][i] = frand() * 0.2f;
            int8_weights(dw[l][j], outs[j], ins[j], dq[l][j], dscale[l][j]);
        }
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < DD; i++) dnorm[l][j][i] = 1.f + 0.2f * frand();
        QvlLinear lin[7];
        for (int j = 0; j < 7; j++) lin[j] = (QvlLinear){W_INT8, outs[j], ins[j], 0, dq[l][j], dscale[l][j], NULL, NULL};
        layers[l] = (QvlLayer){dnorm[l][0], dnorm[l][1], dnorm[l][2], dnorm[l][3],
                               lin[0], lin[1], lin[2], lin[3], lin[4], lin[5], lin[6]};
    }
    for (int i = 0; i < (int)(sizeof keys / sizeof(float)); i++) {
        ((float*)keys)[i] = ((float*)rk)[i] = frand();
        ((float*)values)[i] = ((float*)rv)[i] = frand();
    }
    for (int i = 0; i < DD; i++) x[i] = rx[i] = frand();
    for (int i = 0; i < DHD; i++) cos[i] = cosf(0.3f * i), sin[i] = sinf(0.3f * i);
    const int64_t table = 0, slot = DPOS; /* one block of DCAP positions per layer */
    /* Qwen3-VL's layers: every head dim rotated, no output gate, no Gated DeltaNet (no states) */
    const QvlShape shape = {DD, DH, DKV, DHD, DHD, 0, 0, 0, 0, 0, 0, 0, 1e-6f};
    const QvlStates none = {0};
    int status = qvl_decode_layers(layers, DL, &shape, x, F32, 1, cos, sin, keys, values, DKV * DCAP * DHD, &table, 1,
                                   DCAP, DKV * DCAP * DHD, DCAP * DHD, &slot, &none, 2);
    if (status != 0) {
        printf("FAIL decode layers returned %d\n", status);
        failures++;
        return;
    }
    for (int l = 0; l < DL; l++) {
        float xn[DD], q[DH * DHD], k[DKV * DHD], v[DKV * DHD], att[DH * DHD], a[DD], g[DI], u[DI];
        ref_norm(rx, dnorm[l][0], xn, DD);
        ref_linear(l, 0, xn, DH * DHD, DD, q), ref_linear(l, 1, xn, DKV * DHD, DD, k), ref_linear(l, 2, xn, DKV * DHD, DD, v);
        for (int h = 0; h < DH; h++) ref_norm(q + h * DHD, dnorm[l][2], q + h * DHD, DHD);
        for (int h = 0; h < DKV; h++) ref_norm(k + h * DHD, dnorm[l][3], k + h * DHD, DHD);
        ref_rope(q, DH, cos, sin), ref_rope(k, DKV, cos, sin);
        for (int h = 0; h < DKV; h++) {
            memcpy(rk[l][h][DPOS], k + h * DHD, DHD * sizeof(float));
            memcpy(rv[l][h][DPOS], v + h * DHD, DHD * sizeof(float));
        }
        reference_attention(q, &rk[l][0][0][0], &rv[l][0][0][0], DH, DKV, DPOS + 1, DCAP, DHD, att);
        ref_linear(l, 3, att, DD, DH * DHD, a);
        for (int i = 0; i < DD; i++) rx[i] += a[i];
        ref_norm(rx, dnorm[l][1], xn, DD);
        ref_linear(l, 4, xn, DI, DD, g), ref_linear(l, 5, xn, DI, DD, u);
        for (int i = 0; i < DI; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
        ref_linear(l, 6, g, DD, DI, a);
        for (int i = 0; i < DD; i++) rx[i] += a[i];
    }
    check("decode layers f32 (hidden states)", x, rx, DD, 2e-3f);
    check("decode layers f32 (keys written)", &keys[0][0][0][0], &rk[0][0][0][0], DL * DKV * DCAP * DHD, 2e-3f);
}

/* The byte-product kernel (activation codes per group of columns: 8-bit with x86 VNNI and NEON
 * dot products, 7-bit on plain AVX2) against the scheme computed here: each group's codes and
 * step as the kernel defines them (its top code from qvl_q8_levels), its exact integer sum, the
 * steps applied in group order in float32. Then its fusions against the same steps done apart,
 * and a row with a NaN alone turning NaN. */
static float q8_reference(const float* x, const int8_t* w, int64_t K, int group) {
    const float levels = (float)qvl_q8_levels();
    float acc = 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += group) {
        const int64_t n = K - k0 < group ? K - k0 : group;
        float top = 0.f;
        for (int64_t k = 0; k < n; k++) top = fabsf(x[k0 + k]) > top ? fabsf(x[k0 + k]) : top;
        if (top == 0.f) continue;
        const float inv = levels / top;
        int64_t sum = 0;
        for (int64_t k = 0; k < n; k++) sum += (int64_t)w[k0 + k] * round_int(x[k0 + k] * inv);
        acc = fmaf((float)sum, top / levels, acc);
    }
    return acc;
}

static void test_q8_linear(void) {
    enum { K = 320, NMAX = 48, M = 13 };
    static float w[NMAX * K], x[M * K], y[M * NMAX], ref[M * NMAX], z[M * NMAX], res[M * NMAX], nx[M * K];
    static float s8[NMAX], bias[NMAX], nw[K], nb[K];
    static int8_t q8[NMAX * K];
    for (int i = 0; i < NMAX * K; i++) w[i] = frand();
    for (int i = 0; i < M * K; i++) x[i] = frand() * (i % 97 == 5 ? 40.f : 1.f); /* a few outliers */
    for (int i = 0; i < M * NMAX; i++) res[i] = frand();
    for (int i = 0; i < K; i++) nw[i] = 1.f + 0.5f * frand(), nb[i] = 0.1f * frand();
    for (int n = 0; n < NMAX; n++) bias[n] = frand();
    int8_weights(w, NMAX, K, q8, s8);
    int N = 0; /* the last width the kernel took */
    /* 20 columns: two 8-column NEON tiles and a 4-column one; 48: a 32-column x86 tile and a 16-column one */
    for (int width = 20; width <= NMAX; width += NMAX - 20)
        for (int group = 32; group <= 256; group *= 2)
            for (int m = 1; m <= M; m += 4) {
                if (qvl_q8_linear(x, F32, m, K, width, q8, s8, bias, y, 2, group, NULL, NULL, 0.f, 0, NULL) == -2)
                    continue;
                N = width;
                for (int r = 0; r < m; r++)
                    for (int n = 0; n < N; n++)
                        ref[r * N + n] = q8_reference(x + r * K, q8 + n * K, K, group) * s8[n] + bias[n];
                check("q8 linear", y, ref, m * N, 1e-5f);
            }
    {   /* the GELU the kernel fuses (vectorised per build) against the tanh formula */
        enum { G = 203 };
        static float g[G], gref[G];
        for (int i = 0; i < G; i++) {
            g[i] = 16.f * i / (G - 1) - 8.f;
            gref[i] = 0.5f * g[i] * (1.f + tanhf(0.7978845608f * (g[i] + 0.044715f * g[i] * g[i] * g[i])));
        }
        qvl_gelu_tanh(g, G);
        check("tanh-GELU", g, gref, G, 1e-5f);
    }
    if (!N) return; /* no byte products in this build */
    qvl_q8_linear(x, F32, M, K, N, q8, s8, bias, y, 2, 64, NULL, NULL, 0.f, 0, NULL);
    memcpy(ref, y, sizeof(float) * M * N);
    qvl_gelu_tanh(ref, M * N);
    qvl_q8_linear(x, F32, M, K, N, q8, s8, bias, z, 2, 64, NULL, NULL, 0.f, 1, NULL);
    check("q8 linear + GELU", z, ref, M * N, 1e-6f);
    for (int i = 0; i < M * N; i++) ref[i] = y[i] + res[i];
    qvl_q8_linear(x, F32, M, K, N, q8, s8, bias, z, 2, 64, NULL, NULL, 0.f, 0, res);
    check("q8 linear + residual", z, ref, M * N, 1e-6f);
    memcpy(nx, x, sizeof x);
    for (int r = 0; r < M; r++) qvl_layer_norm_row(nx + r * K, K, nw, nb, 1e-6f, F32);
    qvl_q8_linear(nx, F32, M, K, N, q8, s8, bias, ref, 2, 64, NULL, NULL, 0.f, 0, NULL);
    qvl_q8_linear(x, F32, M, K, N, q8, s8, bias, z, 2, 64, nw, nb, 1e-6f, 0, NULL);
    check("q8 linear, layer norm fused", z, ref, M * N, 1e-6f);
    x[3 * K + 7] = NAN;
    qvl_q8_linear(x, F32, M, K, N, q8, s8, bias, z, 2, 64, NULL, NULL, 0.f, 0, NULL);
    int nan_ok = 1;
    for (int r = 0; r < M; r++)
        for (int n = 0; n < N; n++) nan_ok &= r == 3 ? isnan(z[r * N + n]) : z[r * N + n] == y[r * N + n];
    if (!nan_ok) {
        printf("FAIL q8 linear: a NaN in row 3 should turn that row, and only it, NaN\n");
        failures++;
    }
    printf("byte kernel checked\n"); /* the test asserts it ran where the build has it */
}

/* The int4 byte-product kernel (qvl_q4_linear: 8-bit codes per 64 columns on every build that
 * has byte products) against its scheme computed here: each group's codes and step from the
 * kernel's own quantiser, times the weights (q - 8) * scale + zero, summed in double. */
static void test_q4_linear(void) {
    enum { K = 512, N = 48, M = 13, GS = 128 };
    static float x[M * K], y[M * N], ref[M * N], scale[N * (K / GS)], zero[N * (K / GS)], bias[N];
    static uint8_t nib[N * K / 2], q[N * K];
    static int8_t codes[64];
    for (int i = 0; i < M * K; i++) x[i] = frand() * (i % 97 == 5 ? 40.f : 1.f);
    for (int i = 0; i < N * K; i++) q[i] = (uint8_t)((seed = seed * 1664525u + 1013904223u) >> 28);
    for (int i = 0; i < N * K / 2; i++) nib[i] = (uint8_t)(q[2 * i] | q[2 * i + 1] << 4);
    for (int i = 0; i < N * (K / GS); i++) scale[i] = 0.01f + 0.01f * fabsf(frand()), zero[i] = 0.1f * frand();
    for (int n = 0; n < N; n++) bias[n] = frand();
    if (qvl_q4_linear(x, F32, M, K, N, nib, scale, zero, GS, bias, y, 2, 64) == -2) return; /* no byte products */
    for (int r = 0; r < M; r++)
        for (int n = 0; n < N; n++) {
            double acc = bias[n];
            for (int k0 = 0; k0 < K; k0 += 64) {
                int32_t sum;
                const float step = group_codes8(x + r * K + k0, 64, 1, absmax(x + r * K + k0, 64), 127.f, codes, &sum);
                for (int k = 0; k < 64; k++) {
                    const int64_t g = n * (K / GS) + (k0 + k) / GS;
                    acc += (double)codes[k] * step * (((double)q[n * K + k0 + k] - 8) * scale[g] + zero[g]);
                }
            }
            ref[r * N + n] = (float)acc;
        }
    check("q4 linear", y, ref, M * N, 1e-5f);
    printf("int4 byte kernel checked\n");
}

int main(void) {
    printf("features %d\n", qvl_features());
    test_linear();
    test_decode_attention();
    test_decode_layers();
    test_q8_linear();
    test_q4_linear();
    printf(failures ? "%d checks failed\n" : "all checks passed\n", failures);
    return failures ? 1 : 0;
}
