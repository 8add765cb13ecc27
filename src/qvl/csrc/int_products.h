/* The integer attention kernels' product loops in assembly (AVX-512 VNNI): 4 query rows x 4 or 5
 * vectors, vpdpwssd (16-bit pairs: attention_int16.c) or vpdpbusd (bytes: attention_flash.c's
 * 8-bit scores). */
#ifndef QVL_INT_PRODUCTS_H
#define QVL_INT_PRODUCTS_H
#include "common.h"

#if defined(QVL_AVX512) && defined(__AVX512VNNI__)
/* The loops in assembly, accumulators in zmm0-19 from zero, stored to `out` ([4][nv][16]
 * int32) at the end: GCC 12 spills or copies the C loops' 16-20 zmm accumulators once per
 * step, as it copied the AVX2 loop's. Per step: nv vectors of b (b_step bytes apart per step),
 * the 4 rows' words of a (a_row bytes apart) broadcast, 4 x nv `op`: vpdpwssd (16-bit pairs,
 * qvl_attention_i16) or vpdpbusd (unsigned bytes of a, signed bytes of b: qvl_attention_q8). */
#define ZERO(r) "vpxord %%zmm" #r ", %%zmm" #r ", %%zmm" #r "\n\t"
#define STORE(r, i) "vmovdqu32 %%zmm" #r ", " #i "*64(%[out])\n\t"
#define LOOP_HEAD "1:\n\t" \
    "vpbroadcastd (%[a]), %%zmm28\n\t" "vpbroadcastd (%[a], %[ar]), %%zmm29\n\t" \
    "vpbroadcastd (%[a2]), %%zmm30\n\t" "vpbroadcastd (%[a2], %[ar]), %%zmm31\n\t"
#define LOOP_TAIL "add $4, %[a]\n\t" "add $4, %[a2]\n\t" "add %[bs], %[b]\n\t" "dec %[n]\n\t" "jnz 1b\n\t"
/* vector v (register zmm2x) against the 4 rows: accumulators r, r + nv, r + 2 nv, r + 3 nv */
#define ROWS4(op, v, r0, r1, r2, r3) op " %%zmm" v ", %%zmm28, %%zmm" #r0 "\n\t" \
    op " %%zmm" v ", %%zmm29, %%zmm" #r1 "\n\t" op " %%zmm" v ", %%zmm30, %%zmm" #r2 "\n\t" \
    op " %%zmm" v ", %%zmm31, %%zmm" #r3 "\n\t"
#define CLOBBER4 "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
    "xmm12", "xmm13", "xmm14", "xmm15", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", \
    "xmm31", "memory", "cc"

#define PRODUCTS(name4, name5, op) \
/* 4 rows x 4 vectors: out[i][v] (16 int32 each). volatile: the stores to out are its only effect */ \
static inline void name4(const uint32_t* a, int64_t a_row, const uint32_t* b, int64_t b_step, int64_t n, \
                         int32_t* out) { \
    const char* a2 = (const char*)a + 2 * a_row; \
    __asm__ volatile(ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5) ZERO(6) ZERO(7) \
            ZERO(8) ZERO(9) ZERO(10) ZERO(11) ZERO(12) ZERO(13) ZERO(14) ZERO(15) \
            LOOP_HEAD \
            "vmovdqu32 (%[b]), %%zmm24\n\t" "vmovdqu32 64(%[b]), %%zmm25\n\t" \
            "vmovdqu32 128(%[b]), %%zmm26\n\t" "vmovdqu32 192(%[b]), %%zmm27\n\t" \
            ROWS4(op, "24", 0, 4, 8, 12) ROWS4(op, "25", 1, 5, 9, 13) ROWS4(op, "26", 2, 6, 10, 14) \
            ROWS4(op, "27", 3, 7, 11, 15) \
            LOOP_TAIL \
            STORE(0, 0) STORE(1, 1) STORE(2, 2) STORE(3, 3) STORE(4, 4) STORE(5, 5) STORE(6, 6) STORE(7, 7) \
            STORE(8, 8) STORE(9, 9) STORE(10, 10) STORE(11, 11) STORE(12, 12) STORE(13, 13) STORE(14, 14) \
            STORE(15, 15) \
            : [a] "+r"(a), [a2] "+r"(a2), [b] "+r"(b), [n] "+r"(n) \
            : [ar] "r"(a_row), [bs] "r"(b_step), [out] "r"(out) \
            : CLOBBER4); \
} \
 \
/* 4 rows x 5 vectors, the fifth masked: out[i][v] (16 int32 each) */ \
static inline void name5(const uint32_t* a, int64_t a_row, const uint32_t* b, int64_t b_step, int64_t n, \
                         __mmask16 last, int32_t* out) { \
    const char* a2 = (const char*)a + 2 * a_row; \
    __asm__ volatile(ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5) ZERO(6) ZERO(7) ZERO(8) ZERO(9) \
            ZERO(10) ZERO(11) ZERO(12) ZERO(13) ZERO(14) ZERO(15) ZERO(16) ZERO(17) ZERO(18) ZERO(19) \
            LOOP_HEAD \
            "vmovdqu32 (%[b]), %%zmm23\n\t" "vmovdqu32 64(%[b]), %%zmm24\n\t" \
            "vmovdqu32 128(%[b]), %%zmm25\n\t" "vmovdqu32 192(%[b]), %%zmm26\n\t" \
            "vmovdqu32 256(%[b]), %%zmm27%{%[m]%}%{z%}\n\t" \
            ROWS4(op, "23", 0, 5, 10, 15) ROWS4(op, "24", 1, 6, 11, 16) ROWS4(op, "25", 2, 7, 12, 17) \
            ROWS4(op, "26", 3, 8, 13, 18) \
            ROWS4(op, "27", 4, 9, 14, 19) \
            LOOP_TAIL \
            STORE(0, 0) STORE(1, 1) STORE(2, 2) STORE(3, 3) STORE(4, 4) STORE(5, 5) STORE(6, 6) STORE(7, 7) \
            STORE(8, 8) STORE(9, 9) STORE(10, 10) STORE(11, 11) STORE(12, 12) STORE(13, 13) STORE(14, 14) \
            STORE(15, 15) STORE(16, 16) STORE(17, 17) STORE(18, 18) STORE(19, 19) \
            : [a] "+r"(a), [a2] "+r"(a2), [b] "+r"(b), [n] "+r"(n) \
            : [ar] "r"(a_row), [bs] "r"(b_step), [out] "r"(out), [m] "Yk"(last) \
            : CLOBBER4, "xmm16", "xmm17", "xmm18", "xmm19"); \
}
PRODUCTS(products_4x4, products_4x5, "vpdpwssd")
#ifdef __AVX512BF16__
PRODUCTS(bytes_4x4, bytes_4x5, "vpdpbusd")
#endif
#endif

#endif
