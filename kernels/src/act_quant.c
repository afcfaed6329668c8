/* Per-token absmax int8 activation quantisation (BitNet's rule). The scalar
 * reference is here; SIMD versions of one contiguous row are in x86/. */
#include <math.h>
#include <string.h>

#include "dtype.h"
#include "internal.h"

void ulb_quant_tail_ref(const void *x, ulb_dtype dt, int64_t k0, int64_t K, float inv, int8_t *q) {
    for (int64_t k = k0; k < K; k++) {
        float r = rintf(ulb_load_elem(x, dt, k) * inv);
        r = fminf(fmaxf(r, -128.0f), 127.0f);
        q[k] = (int8_t)r;
    }
}

/* inv = 127 / max(max|x|, 1e-5); q = clamp(rint(x * inv), -128, 127).
 * Returns inv, or NaN (q untouched) when the row holds NaN or infinity. */
static float quant_row_strided(const void *x, ulb_dtype dt, int64_t K, int64_t incx, int8_t *q) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        const float v = ulb_load_elem(x, dt, k * incx);
        if (isnan(v)) return NAN;
        amax = fmaxf(amax, fabsf(v));
    }
    if (!isfinite(amax)) return NAN;
    const float inv = 127.0f / fmaxf(amax, 1e-5f);
    for (int64_t k = 0; k < K; k++) {
        float r = rintf(ulb_load_elem(x, dt, k * incx) * inv);
        r = fminf(fmaxf(r, -128.0f), 127.0f);
        q[k] = (int8_t)r;
    }
    return inv;
}

void ulb_group_sums_ref(const int8_t *q, int64_t K, int64_t group, int32_t *xsum) {
    for (int64_t g0 = 0; g0 < K; g0 += group) {
        const int64_t g1 = g0 + group < K ? g0 + group : K;
        int32_t s = 0;
        for (int64_t k = g0; k < g1; k++) s += q[k];
        *xsum++ = s;
    }
}

float ulb_quant_row_ref(const void *x, ulb_dtype dt, int64_t K, int64_t group, int8_t *q, int32_t *xsum) {
    const float inv = quant_row_strided(x, dt, K, 1, q);
    if (!isnan(inv)) ulb_group_sums_ref(q, K, group, xsum);
    return inv;
}

ulb_status ulb_quantize_act(int64_t N, int64_t K, int64_t K_pad, int64_t group_size,
                            const void *x, ulb_dtype dt, int64_t ldx, int64_t incx,
                            int8_t *xq, float *xscale, int32_t *xsum) {
    if (N < 0 || K <= 0 || K_pad < K || group_size <= 0) return ULB_ERR_SHAPE;
    if (dt != ULB_DT_F32 && dt != ULB_DT_BF16) return ULB_ERR_DTYPE;
    const ulb_quant_row_fn quant_row = ulb_quant_row_for_isa(ulb_isa_active());
    const size_t esize = dt == ULB_DT_F32 ? 4 : 2;
    const int64_t n_groups = (K_pad + group_size - 1) / group_size;
    const int64_t row_groups = (K + group_size - 1) / group_size; /* the rest cover only padding */
    for (int64_t n = 0; n < N; n++) {
        const void *row = (const char *)x + (size_t)(n * ldx) * esize;
        int8_t *q = xq + n * K_pad;
        int32_t *s = xsum + n * n_groups;
        float inv;
        if (incx == 1) {
            inv = quant_row(row, dt, K, group_size, q, s);
        } else {
            inv = quant_row_strided(row, dt, K, incx, q);
            if (!isnan(inv)) ulb_group_sums_ref(q, K, group_size, s);
        }
        /* A row with NaN or infinity gives a NaN output row, as F.linear would. */
        if (isnan(inv)) {
            memset(q, 0, (size_t)K);
            memset(s, 0, (size_t)row_groups * sizeof *s);
        }
        memset(q + K, 0, (size_t)(K_pad - K));
        memset(s + row_groups, 0, (size_t)(n_groups - row_groups) * sizeof *s);
        xscale[n] = isnan(inv) ? NAN : 1.0f / inv;
    }
    return ULB_OK;
}
