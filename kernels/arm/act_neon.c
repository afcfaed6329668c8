/* NEON per-token int8 quantisation of one contiguous row; bit-identical to
 * ulb_quant_row_ref: the same fp32 product, frintn for rintf (nearest even,
 * the default rounding mode), fmax/fmin for the clamp. fmax propagates NaN,
 * so a row holding one ends with a NaN maximum. The last K % 16 elements and
 * the group sums go through the reference. */
#pragma GCC target("arch=armv8-a")
#include <arm_neon.h>
#include <math.h>

#include "../src/dtype.h"
#include "../src/internal.h"

static inline float32x4_t load4(const void *x, ulb_dtype dt, int64_t k) {
    if (dt == ULB_DT_F32) return vld1q_f32((const float *)x + k);
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)x + k), 16));
}

float ulb_quant_row_neon(const void *x, ulb_dtype dt, int64_t K, int64_t group, int8_t *q, int32_t *xsum) {
    const int64_t K16 = K / 16 * 16;
    float32x4_t amax[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
    for (int64_t k = 0; k < K16; k += 16)
        for (int i = 0; i < 4; i++) amax[i] = vmaxq_f32(amax[i], vabsq_f32(load4(x, dt, k + 4 * i)));
    float a = vmaxvq_f32(vmaxq_f32(vmaxq_f32(amax[0], amax[1]), vmaxq_f32(amax[2], amax[3])));
    int finite = !isnan(a);
    for (int64_t k = K16; k < K; k++) {
        const float v = ulb_load_elem(x, dt, k);
        if (isnan(v)) finite = 0;
        a = fmaxf(a, fabsf(v));
    }
    if (!finite || !isfinite(a)) return NAN;
    const float inv = 127.0f / fmaxf(a, 1e-5f);
    const float32x4_t lo = vdupq_n_f32(-128.0f), hi = vdupq_n_f32(127.0f);
    for (int64_t k = 0; k < K16; k += 16) {
        int32x4_t r[4];
        for (int i = 0; i < 4; i++)
            r[i] = vcvtq_s32_f32(vminq_f32(vmaxq_f32(vrndnq_f32(vmulq_n_f32(load4(x, dt, k + 4 * i), inv)), lo), hi));
        const int16x8_t h0 = vcombine_s16(vqmovn_s32(r[0]), vqmovn_s32(r[1]));
        const int16x8_t h1 = vcombine_s16(vqmovn_s32(r[2]), vqmovn_s32(r[3]));
        vst1q_s8(q + k, vcombine_s8(vqmovn_s16(h0), vqmovn_s16(h1)));
    }
    ulb_quant_tail_ref(x, dt, K16, K, inv, q);
    ulb_group_sums_ref(q, K, group, xsum);
    return inv;
}
