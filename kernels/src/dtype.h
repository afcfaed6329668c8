/* Element access for the activation dtypes the kernels accept. */
#ifndef ULB_DTYPE_H
#define ULB_DTYPE_H

#include <stdint.h>
#include <string.h>

#include "ulb/ulb.h"

static inline float ulb_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch does; NaN stays NaN. */
static inline uint16_t ulb_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float ulb_load_elem(const void *p, ulb_dtype dt, int64_t i) {
    return dt == ULB_DT_F32 ? ((const float *)p)[i] : ulb_bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void ulb_store_elem(void *p, ulb_dtype dt, int64_t i, float v) {
    if (dt == ULB_DT_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = ulb_f32_to_bf16(v);
}

#endif
