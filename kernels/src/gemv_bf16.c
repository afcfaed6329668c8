/* One-token GEMV over a plain bf16 weight (the layers left unquantized, such
 * as lm_head): y = W x (+ bias) with fp32 accumulation, split over rows
 * between threads. PyTorch's bf16 F.linear reads such a weight at well below
 * DRAM speed at N = 1 on CPUs without AMX (benchmarks/results/archive/BENCHMARKS_NOTES.md). */
#include "dtype.h"
#include "internal.h"

#define ROWS_PER_UNIT 64 /* scheduling granularity */

typedef struct {
    const uint16_t *w;
    int64_t ldw, M, K;
    const uint16_t *x;
    const void *bias;
    ulb_dtype bias_dt;
    void *y;
    ulb_dtype y_dt;
    ulb_gemv_bf16_rows_fn rows;
} bf16_job;

static void bf16_units(void *ctx, int64_t u0, int64_t u1) {
    const bf16_job *j = ctx;
    float out[ROWS_PER_UNIT];
    for (int64_t u = u0; u < u1; u++) {
        const int64_t m0 = u * ROWS_PER_UNIT;
        const int64_t rows = j->M - m0 < ROWS_PER_UNIT ? j->M - m0 : ROWS_PER_UNIT;
        j->rows(j->w + m0 * j->ldw, j->ldw, j->K, rows, j->x, out);
        for (int64_t r = 0; r < rows; r++) {
            float v = out[r];
            if (j->bias) v = v + ulb_load_elem(j->bias, j->bias_dt, m0 + r);
            ulb_store_elem(j->y, j->y_dt, m0 + r, v);
        }
    }
}

ulb_status ulb_gemv_bf16(const uint16_t *w, int64_t M, int64_t K, int64_t ldw, const uint16_t *x, int64_t incx,
                         const void *bias, ulb_dtype bias_dt, void *y, ulb_dtype y_dt, int nthreads) {
    if (M < 0 || K < 0 || ldw < K) return ULB_ERR_SHAPE;
    if ((y_dt != ULB_DT_F32 && y_dt != ULB_DT_BF16) || (bias && bias_dt != ULB_DT_F32 && bias_dt != ULB_DT_BF16))
        return ULB_ERR_DTYPE;
    if (M == 0) return ULB_OK;
    uint16_t *xc = NULL; /* strided activations, gathered */
    if (incx != 1) {
        xc = ulb_aligned_alloc((size_t)(K > 0 ? K : 1) * sizeof(uint16_t));
        if (!xc) return ULB_ERR_NOMEM;
        for (int64_t k = 0; k < K; k++) xc[k] = x[k * incx];
    }
    const ulb_isa isa = ulb_isa_active();
    const bf16_job job = {w, ldw, M, K, xc ? xc : x, bias, bias_dt, y, y_dt, ulb_gemv_bf16_rows_for_isa(isa)};
    if (M * K * 2 < ULB_PARALLEL_MIN_BYTES) nthreads = 1;
    const ulb_status st = ulb_parallel(ulb_sched_family(16, isa), nthreads, (M + ROWS_PER_UNIT - 1) / ROWS_PER_UNIT,
                                       bf16_units, (void *)&job);
    ulb_aligned_free(xc);
    return st;
}

int ulb_gemv_bf16_native(int isa) {
    return isa >= 0 && isa < ULB_ISA_COUNT && ulb_gemv_bf16_rows_for_isa((ulb_isa)isa) != ulb_gemv_bf16_rows_ref;
}
