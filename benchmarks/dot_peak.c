/* The machine's AVX512-BF16 dot-product peak: a loop of nothing but independent vdpbf16ps
 * (16 accumulators), the ceiling for qvl's attention kernel and for oneDNN's bf16 GEMMs; with
 * -DINT8 the same loop of vpdpbusd (AVX512-VNNI), the ceiling for qvl's byte-product kernel.
 *
 *     cc -O3 -march=native -fopenmp benchmarks/dot_peak.c -o /tmp/dot_peak
 *     OMP_NUM_THREADS=1 /tmp/dot_peak; OMP_NUM_THREADS=2 /tmp/dot_peak
 *     cc -O3 -march=native -fopenmp -DINT8 benchmarks/dot_peak.c -o /tmp/dot_peak8
 */
#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
/* prints T operations/s over all threads (2 per multiply-add: 64 per vdpbf16ps, 128 per vpdpbusd) */
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
#ifdef INT8
            for (int i = 0; i < 16; i++) a[i] = (__m512)_mm512_dpbusd_epi32((__m512i)a[i], (__m512i)x, (__m512i)y);
#else
            for (int i = 0; i < 16; i++) a[i] = _mm512_dpbf16_ps(a[i], x, y);
#endif
            __asm__ volatile("" : "+v"(x)); /* keeps the loop from being folded */
        }
        for (int i = 0; i < 16; i++) res += _mm512_reduce_add_ps(a[i]);
    }
    double dt = omp_get_wtime() - t0;
#ifdef INT8
    const double ops = 128;
#else
    const double ops = 64;
#endif
    printf("%.3f T%s/s (%f)\n", (double)omp_get_max_threads() * iters * ops / dt / 1e12,
#ifdef INT8
           "OP",
#else
           "FLOP",
#endif
           res);
}
