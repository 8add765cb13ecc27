/* Plain AVX2's multiply-add ceilings: bare loops of independent accumulators (10, in registers)
 * of the float32 FMA (8 multiply-adds per instruction: the float32 path's GEMMs), vpmaddwd +
 * vpaddd (16: qvl's 16-bit pair kernel) and vpmaddubsw + vpmaddwd by ones + vpaddd (32: the
 * byte kernel's 7-bit codes on plain AVX2). Their ratio is the most any integer path can gain
 * over float32 products on this core (docs/benchmarks.md section 53).
 *
 *     cc -O3 -mavx2 -mfma -fopenmp benchmarks/avx2_peak.c -o /tmp/avx2_peak && OMP_NUM_THREADS=2 /tmp/avx2_peak
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#define N 10
int main(void) {
    const long iters = 200000000;
    const char* names[] = {"fma ymm (float32)", "vpmaddwd + vpaddd", "vpmaddubsw + vpmaddwd + vpaddd"};
    const double macs[] = {8, 16, 32};
    for (int kind = 0; kind < 3; kind++) {
        const double t0 = omp_get_wtime();
        float res = 0;
#pragma omp parallel reduction(+ : res)
        {
            if (kind == 0) {
                __m256 f[N];
                for (int i = 0; i < N; i++) f[i] = _mm256_setzero_ps();
                __m256 x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.999f);
                for (long it = 0; it < iters / N; it++) {
                    for (int i = 0; i < N; i++) f[i] = _mm256_fmadd_ps(x, y, f[i]);
                    __asm__ volatile("" : "+x"(x)); /* keeps the loop from being folded */
                }
                for (int i = 0; i < N; i++) res += f[i][0];
            } else {
                __m256i a[N];
                for (int i = 0; i < N; i++) a[i] = _mm256_setzero_si256();
                __m256i p = _mm256_set1_epi16(3), q = _mm256_set1_epi16(5), ones = _mm256_set1_epi16(1);
                for (long it = 0; it < iters / N; it++)
                    for (int i = 0; i < N; i++) {
                        __asm__ volatile("" : "+x"(p)); /* a product per accumulator, none hoisted */
                        a[i] = _mm256_add_epi32(a[i], kind == 1 ? _mm256_madd_epi16(p, q)
                                                                : _mm256_madd_epi16(_mm256_maddubs_epi16(p, q), ones));
                    }
                for (int i = 0; i < N; i++) res += (float)_mm256_extract_epi32(a[i], 0);
            }
        }
        const double dt = omp_get_wtime() - t0;
        printf("%-32s %6.1f G multiply-adds/s (%g)\n", names[kind], omp_get_max_threads() * iters * macs[kind] / dt / 1e9,
               res);
    }
}
