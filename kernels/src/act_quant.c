/* Per-token absmax int8 activation quantisation (BitNet's rule) and the
 * fp32 <-> bf16 conversions of the epilogue. */
#include <math.h>
#include <string.h>

#include "internal.h"
#include "dtype.h"

ulb_status ulb_quantize_act(int64_t N, int64_t K, int64_t K_pad, int64_t group_size,
                            const void *x, ulb_dtype dt, int64_t ldx, int64_t incx,
                            int8_t *xq, float *xscale, int32_t *xsum) {
    if (N < 0 || K <= 0 || K_pad < K || group_size <= 0) return ULB_ERR_SHAPE;
    if (dt != ULB_DT_F32 && dt != ULB_DT_BF16) return ULB_ERR_DTYPE;
    const int64_t n_groups = (K_pad + group_size - 1) / group_size;
    for (int64_t n = 0; n < N; n++) {
        const int64_t row = n * ldx;
        float amax = 0.0f;
        int finite = 1;
        for (int64_t k = 0; k < K; k++) {
            const float v = ulb_load_elem(x, dt, row + k * incx);
            if (!isfinite(v)) finite = 0;
            amax = fmaxf(amax, fabsf(v));
        }
        int8_t *q = xq + n * K_pad;
        memset(q, 0, (size_t)K_pad);
        if (!finite) {
            /* Propagate like F.linear would: the whole output row is NaN. */
            xscale[n] = NAN;
        } else {
            const float inv = 127.0f / fmaxf(amax, 1e-5f);
            for (int64_t k = 0; k < K; k++) {
                float r = rintf(ulb_load_elem(x, dt, row + k * incx) * inv);
                r = fminf(fmaxf(r, -128.0f), 127.0f);
                q[k] = (int8_t)r;
            }
            xscale[n] = 1.0f / inv;
        }
        for (int64_t g = 0; g < n_groups; g++) {
            const int64_t k1 = (g + 1) * group_size < K_pad ? (g + 1) * group_size : K_pad;
            int32_t s = 0;
            for (int64_t k = g * group_size; k < k1; k++) s += q[k];
            xsum[n * n_groups + g] = s;
        }
    }
    return ULB_OK;
}
