/* One-token 1-bit GEMV by table lookup with NEON tbl (ARMv8.0), after
 * T-MAC, over VNNI or LANES tiles alike: ld4 splits a VNNI tile into its four
 * byte slots (byte 4l + b of row l: slot b, layout.h), which a LANES tile
 * holds as its four 16-byte quarters. Byte l of slot b holds, in its low
 * nibble, the codes of row l at columns b, 4 + b, 8 + b, 12 + b and in its
 * high nibble those at 16 + b, ..., 28 + b of the k-step, so one 16-entry
 * table per slot and nibble gives 16 rows' dot over 4 columns in one lookup.
 *
 * Tables, per token and k-step ks, ULB_LUT1_STEP_BYTES bytes: 16 of 16
 * bytes, T[b][f][kind] at 16 (4b + 2f + kind), entry n
 *   kind 0 (L): sum_{i<4} bit_i(n) * (x[32ks + 16f + 4i + b] & 15)        in [0, 60]
 *   kind 1 (H): sum_{i<4} bit_i(n) * (x[32ks + 16f + 4i + b] >> 4) + 32   in [0, 60]
 * (>> arithmetic), so L + 16 (H - 32) is the exact dot of nibble n with its
 * four activations. The four lookups of a row in two slots add in unsigned
 * bytes (at most 240), then L + 16 H in unsigned 16 bits: a k-step adds at
 * most 8 * 60 * 17 = 8160, so CHUNK k-steps fit before they widen to 32 bits,
 * less the bias of 8 * 32 * 16 per k-step. Exact, so bit for bit the
 * reference. Each k-step's tables are loaded half at a time (the slots 0, 1
 * and 2, 3 of every tile), so that they, the tiles' sums and a tile's slots
 * fit the 32 registers. */
#pragma GCC target("arch=armv8-a")
/* GCC's scheduling before register allocation hoists the field extractions
 * of whole k-steps ahead of their dot products, and spills. */
#pragma GCC optimize("no-schedule-insns")
#include <arm_neon.h>
#include <string.h>

#include "../src/internal.h"

#define CHUNK 8
#define STEP_BIAS (8 * 32 * 16)

void ulb_lut1_build_neon(const int8_t *xq, int64_t ksteps, uint8_t *lut) {
    uint8x16_t pick[4][4]; /* [b][i]: entry n picks column 4i + b where bit i of n is set (0xFF reads 0) */
    for (int b = 0; b < 4; b++)
        for (int i = 0; i < 4; i++) {
            uint8_t idx[16];
            for (int n = 0; n < 16; n++) idx[n] = n >> i & 1 ? (uint8_t)(4 * i + b) : 0xFF;
            pick[b][i] = vld1q_u8(idx);
        }
    const uint8x16_t low = vdupq_n_u8(15), bias = vdupq_n_u8(32);
    for (int64_t ks = 0; ks < ksteps; ks++) {
        uint8_t *step = lut + ks * ULB_LUT1_STEP_BYTES;
        for (int f = 0; f < 2; f++) {
            const int8x16_t v = vld1q_s8(xq + 32 * ks + 16 * f);
            const uint8x16_t src[2] = {vandq_u8(vreinterpretq_u8_s8(v), low), vreinterpretq_u8_s8(vshrq_n_s8(v, 4))};
            for (int b = 0; b < 4; b++)
                for (int kind = 0; kind < 2; kind++) {
                    const uint8x16_t s = src[kind];
                    uint8x16_t t = vaddq_u8(vaddq_u8(vqtbl1q_u8(s, pick[b][0]), vqtbl1q_u8(s, pick[b][1])),
                                            vaddq_u8(vqtbl1q_u8(s, pick[b][2]), vqtbl1q_u8(s, pick[b][3])));
                    if (kind) t = vaddq_u8(t, bias);
                    vst1q_u8(step + 16 * (4 * b + 2 * f + kind), t);
                }
        }
    }
}

/* Slots 2h and 2h + 1 of a tile: from ld4 (VNNI) or its quarters (LANES). */
ALWAYS_INLINE void slots(const uint8_t *tile, const int h, const int lanes, uint8x16_t *s) {
    if (lanes) {
        s[0] = vld1q_u8(tile + 32 * h);
        s[1] = vld1q_u8(tile + 32 * h + 16);
        return;
    }
    const uint8x16x4_t v = vld4q_u8(tile);
    s[0] = v.val[2 * h];
    s[1] = v.val[2 * h + 1];
}

ALWAYS_INLINE void group(const uint8_t *codes, int64_t steps, int64_t pf_steps, const int nt, const int lanes,
                         const uint8_t *lut, int64_t dist, int32_t *acc) {
    const uint8x16_t low = vdupq_n_u8(15), sixteen = vdupq_n_u8(16);
    for (int i = 0; i < nt * ULB_TILE; i++) acc[i] = -(int32_t)(STEP_BIAS * steps);
    for (int64_t c0 = 0; c0 < steps; c0 += CHUNK) {
        const int64_t c1 = c0 + CHUNK < steps ? c0 + CHUNK : steps;
        uint16x8_t sum[ULB_PANEL_TILES][2];
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) sum[t][0] = sum[t][1] = vdupq_n_u16(0);
        for (int64_t ks = c0; ks < c1; ks++) {
            const uint8_t *step = codes + ks * nt * ULB_TILE_BYTES, *tab = lut + ks * ULB_LUT1_STEP_BYTES;
            if (ks < pf_steps)
#pragma GCC unroll 4
                for (int t = 0; t < nt; t++) __builtin_prefetch(step + t * ULB_TILE_BYTES + dist, 0, 2);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                /* The tiles are read again for h = 1: kept from h = 0, their
                 * slots 2 and 3 would not fit the registers with the rest. */
                __asm__ volatile("" ::: "memory");
                /* [slot 2h + j][nibble f][kind] at 16 (4j + 2f + kind) */
                const uint8x16x4_t t0 = vld1q_u8_x4(tab + 128 * h), t1 = vld1q_u8_x4(tab + 128 * h + 64);
                const uint8x16x4_t *tj[2] = {&t0, &t1};
#pragma GCC unroll 4
                for (int t = 0; t < nt; t++) {
                    uint8x16_t s[2];
                    slots(step + t * ULB_TILE_BYTES, h, lanes, s);
                    uint8x16_t l = vdupq_n_u8(0), hh = vdupq_n_u8(0);
#pragma GCC unroll 2
                    for (int j = 0; j < 2; j++) {
                        const uint8x16_t lo = vandq_u8(s[j], low), hi = vshrq_n_u8(s[j], 4);
                        l = vaddq_u8(l, vaddq_u8(vqtbl1q_u8(tj[j]->val[0], lo), vqtbl1q_u8(tj[j]->val[2], hi)));
                        hh = vaddq_u8(hh, vaddq_u8(vqtbl1q_u8(tj[j]->val[1], lo), vqtbl1q_u8(tj[j]->val[3], hi)));
                    }
                    sum[t][0] = vmlal_u8(vaddw_u8(sum[t][0], vget_low_u8(l)), vget_low_u8(hh), vget_low_u8(sixteen));
                    sum[t][1] = vmlal_high_u8(vaddw_high_u8(sum[t][1], l), hh, sixteen);
                }
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                int32_t *o = acc + ULB_TILE * t + 8 * half;
                const uint16x8_t v = sum[t][half];
                vst1q_s32(o, vreinterpretq_s32_u32(vaddw_u16(vreinterpretq_u32_s32(vld1q_s32(o)), vget_low_u16(v))));
                vst1q_s32(o + 4, vreinterpretq_s32_u32(vaddw_high_u16(vreinterpretq_u32_s32(vld1q_s32(o + 4)), v)));
            }
    }
}

void ulb_lut1_group_neon(const uint8_t *codes, int64_t steps, int64_t pf_steps, int nt, int lanes,
                         const uint8_t *lut, int64_t dist, int32_t *acc) {
#define ULB_LUT1_NT(NT)                                                                            \
    case NT:                                                                                       \
        if (lanes) group(codes, steps, pf_steps, NT, 1, lut, dist, acc);                           \
        else group(codes, steps, pf_steps, NT, 0, lut, dist, acc);                                 \
        return;
    switch (nt) { ULB_LUT1_NT(1) ULB_LUT1_NT(2) ULB_LUT1_NT(3) ULB_LUT1_NT(4) }
#undef ULB_LUT1_NT
}
