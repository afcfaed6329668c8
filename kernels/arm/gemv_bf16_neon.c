/* NEON rows kernel of the one-token bf16 GEMV, bit for bit
 * ref/gemv_bf16_ref.c: lane i of half h of a 32-column chunk is column
 * 2i + h, each fused-multiply-added (fmla) into accumulator set chunk mod 4.
 * The 16 lanes x 2 halves x 4 sets are 32 registers, so each row goes in two
 * passes, lanes 0-7 (columns 0-15 of every chunk) and lanes 8-15 (columns
 * 16-31), the second from cache; a pass's 32-bit words hold (even, odd)
 * column pairs, whose halves widen to fp32 with a shift and a mask. */
#pragma GCC target("arch=armv8-a")
#include <arm_neon.h>
#include <string.h>

#include "../src/internal.h"

typedef struct {
    float32x4_t e[2], o[2]; /* lanes 8p + 0-3, 8p + 4-7 of halves 0 (even columns) and 1 (odd) */
} lanes8;

ALWAYS_INLINE void widen(uint32x4_t v, float32x4_t *even, float32x4_t *odd) {
    *even = vreinterpretq_f32_u32(vshlq_n_u32(v, 16));
    *odd = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xFFFF0000u)));
}

/* The 16 columns at w and x into s. */
ALWAYS_INLINE void half_chunk(const uint16_t *w, const uint16_t *x, lanes8 *s) {
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++) {
        float32x4_t we, wo, xe, xo;
        widen(vld1q_u32((const uint32_t *)(w + 8 * r)), &we, &wo);
        widen(vld1q_u32((const uint32_t *)(x + 8 * r)), &xe, &xo);
        s->e[r] = vfmaq_f32(s->e[r], we, xe);
        s->o[r] = vfmaq_f32(s->o[r], wo, xo);
    }
}

/* Lanes 8p .. 8p + 7 of a row, (v[i] of the reference) for i in them, in
 * its order: sets then halves. */
ALWAYS_INLINE void row_pass(const uint16_t *w, int64_t K, const int p, const uint16_t *x, const uint16_t *xt,
                            float32x4_t *v) {
    const int64_t full = K / 32, rest = K % 32;
    lanes8 s[ULB_BF16_SETS];
    for (int i = 0; i < ULB_BF16_SETS; i++) s[i].e[0] = s[i].e[1] = s[i].o[0] = s[i].o[1] = vdupq_n_f32(0);
    int64_t c = 0;
    for (; c + ULB_BF16_SETS <= full; c += ULB_BF16_SETS)
#pragma GCC unroll 4
        for (int i = 0; i < ULB_BF16_SETS; i++) half_chunk(w + 32 * (c + i) + 16 * p, x + 32 * (c + i) + 16 * p, &s[i]);
    for (; c < full; c++) half_chunk(w + 32 * c + 16 * p, x + 32 * c + 16 * p, &s[c % ULB_BF16_SETS]);
    if (rest) {
        uint16_t wt[32] = {0};
        memcpy(wt, w + 32 * full, (size_t)rest * sizeof(uint16_t));
        half_chunk(wt + 16 * p, xt + 16 * p, &s[c % ULB_BF16_SETS]);
    }
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++) {
        const float32x4_t e = vaddq_f32(vaddq_f32(s[0].e[r], s[1].e[r]), vaddq_f32(s[2].e[r], s[3].e[r]));
        const float32x4_t o = vaddq_f32(vaddq_f32(s[0].o[r], s[1].o[r]), vaddq_f32(s[2].o[r], s[3].o[r]));
        v[r] = vaddq_f32(e, o);
    }
}

void ulb_gemv_bf16_rows_neon(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                             float *out) {
    const int64_t full = K / 32, rest = K % 32;
    uint16_t xt[32] = {0}; /* the last partial chunk, zero padded */
    memcpy(xt, x + 32 * full, (size_t)rest * sizeof(uint16_t));
    for (int64_t r = 0; r < rows; r++) {
        float32x4_t lo[2], hi[2];
        row_pass(w + r * ldw, K, 0, x, xt, lo);
        row_pass(w + r * ldw, K, 1, x, xt, hi);
        /* v[i] + v[i + 8], then + v[i + 4], + v[i + 2], + v[i + 1] */
        const float32x4_t v4 = vaddq_f32(vaddq_f32(lo[0], hi[0]), vaddq_f32(lo[1], hi[1]));
        const float32x2_t v2 = vadd_f32(vget_low_f32(v4), vget_high_f32(v4));
        out[r] = vget_lane_f32(v2, 0) + vget_lane_f32(v2, 1);
    }
}
