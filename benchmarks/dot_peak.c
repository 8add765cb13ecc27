/* The machine's AVX512-BF16 dot-product peak: a loop of nothing but independent vdpbf16ps
 * (16 accumulators), the ceiling for qvl's attention kernel and for oneDNN's bf16 GEMMs.
 *
 *     cc -O3 -march=native -fopenmp benchmarks/dot_peak.c -o /tmp/dot_peak
 *     OMP_NUM_THREADS=1 /tmp/dot_peak; OMP_NUM_THREADS=2 /tmp/dot_peak
 */
#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
/* prints TFLOP/s over all threads (64 flops per instruction) */
int main(void) {
    double t0 = omp_get_wtime();
    long iters = 200000000;
    float res = 0;
#pragma omp parallel reduction(+:res)
    {
        __m512 a[16];
        for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
        __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3f003f00);
        for (long it = 0; it < iters / 16; it++) {
            for (int i = 0; i < 16; i++) a[i] = _mm512_dpbf16_ps(a[i], x, y);
            __asm__ volatile("" : "+v"(x)); /* keeps the loop from being folded */
        }
        for (int i = 0; i < 16; i++) res += _mm512_reduce_add_ps(a[i]);
    }
    double dt = omp_get_wtime() - t0;
    printf("%.3f TFLOP/s (%f)\n", (double)omp_get_max_threads() * iters * 64 / dt / 1e12, res);
}
