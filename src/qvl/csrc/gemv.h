/* The decode GEMV (gemv.c) as team.h items, for qvl_linear and the one-call decode step
 * (decode_step.c): a product's activations are prepared once (qvl_gemv_prepare: float32 rows,
 * and the integer codes its weights' products read), then its weight rows are items of a
 * takeover job, each block of rows computed into a thread's own buffer and written to y by
 * whichever thread commits it. The bits of a row's result depend on neither the blocks nor the
 * thread. */
#ifndef QVL_GEMV_H
#define QVL_GEMV_H
#include "quantise.h"
#include "team.h"

enum { FORM_Q16 = 1, FORM_Q8 = 2, FORM_AMX = 4 }; /* the activation forms a product reads, beside float32 */

/* One product's activations, in the forms its tier's products read; every buffer at the same
 * place whatever the forms (a thread that fell behind reads stale values, never a stale pointer). */
typedef struct {
    int64_t M, K, gs; /* gs: the int4 weights' group size the codes' sums are for */
    float* xf;        /* [M][K] float32 */
    Q16 q16;          /* FORM_Q16: int8 weights, K whole chunks */
    QuantX q8;        /* FORM_Q8: int4 weights, K whole chunks, groups the integer path takes */
    AmxCodes amx;     /* FORM_AMX: q16 split for AMX tiles */
} GemvInput;

/* y [M][N] (dt) = x . W^T (+ bias) for the linear l (W in one of gemv.c's layouts) reading `in`
 * in `forms`, its items laid out for `threads` threads: first AMX blocks of 16 weight rows, then
 * blocks of the rest. */
typedef struct {
    QvlLinear l;
    const GemvInput* in;
    int dt, forms, path;
    void* y;
    int64_t amx_blocks, first_row, block_rows, items;
} GemvProduct;

/* Several products as one takeover job: product i's items are the job's items first[i]..first[i+1]-1. */
typedef struct {
    int64_t n;
    const GemvProduct* p;
    const int64_t* first; /* [n + 1] */
} GemvJob;

int qvl_gemv_forms(const QvlLinear* l, int64_t M);
int64_t qvl_gemv_input_bytes(int64_t M, int64_t K);
void qvl_gemv_input(GemvInput* in, int64_t M, int64_t K, char* mem);
void qvl_gemv_prepare(GemvInput* in, int forms, const void* x, int dt, int64_t M, int64_t gs, int threads);
void qvl_gemv_product(GemvProduct* p, const QvlLinear* l, const GemvInput* in, int forms, int dt, void* y,
                      int threads);
int64_t qvl_gemv_own_floats(const GemvProduct* p);
TeamJob qvl_gemv_job(const GemvJob* job);

#endif
