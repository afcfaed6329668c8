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
 *   kind 0 (L): sum_{i<4} bit_i(n) * (x[32ks + 16f + 4i + b] & 15)   in [0, 60]
 *   kind 1 (H): sum_{i<4} bit_i(n) * (x[32ks + 16f + 4i + b] >> 4)   in [-32, 28], signed
 * (>> arithmetic), so L + 16 H is the exact dot of nibble n with its four
 * activations. The four lookups of a row in two slots add in bytes (L at
 * most 240, H within [-128, 112]), then L + 16 H in 16 bits: a k-step adds
 * from -16 * 256 to 8 * 60 + 16 * 224, so CHUNK k-steps fit int16 before
 * they widen to 32 bits. Exact, so bit for bit the reference. Each k-step's
 * tables are loaded half at a time (the slots 0, 1 and 2, 3 of every tile),
 * so that they, the tiles' sums and a tile's slots fit the 32 registers. */
#pragma GCC target("arch=armv8-a")
/* GCC's scheduling before register allocation hoists the lookups of whole
 * k-steps ahead of their sums, and spills. */
#pragma GCC optimize("no-schedule-insns")
#include <arm_neon.h>
#include <string.h>

#include "../src/internal.h"

#define CHUNK 8

/* Each table as two lookups: columns 0 and 1 of the nibble (bits 0, 1 of
 * entry n) from p = [s0, s1, s0 + s1] and columns 2 and 3 (bits 2, 3) from
 * q = [s2, s3, s2 + s3], where s_i holds the activations s[4i + b] of the
 * four slots b; out-of-range indices read 0. */
void ulb_lut1_build_neon(const int8_t *xq, int64_t ksteps, uint8_t *lut) {
    uint8x16_t pick[4][2]; /* [b][half]: entry n picks from the pair of columns 2 half, 2 half + 1 */
    for (int b = 0; b < 4; b++)
        for (int half = 0; half < 2; half++) {
            uint8_t idx[16];
            for (int n = 0; n < 16; n++) {
                const int two = n >> (2 * half) & 3;
                idx[n] = two ? (uint8_t)(4 * (two - 1) + b) : 0xFF;
            }
            pick[b][half] = vld1q_u8(idx);
        }
    const uint8x16_t low = vdupq_n_u8(15);
    for (int64_t ks = 0; ks < ksteps; ks++) {
        uint8x16_t p[2][2], q[2][2]; /* [f][kind] */
        for (int f = 0; f < 2; f++) {
            const int8x16_t v = vld1q_s8(xq + 32 * ks + 16 * f);
            const uint8x16_t src[2] = {vandq_u8(vreinterpretq_u8_s8(v), low), vreinterpretq_u8_s8(vshrq_n_s8(v, 4))};
            for (int kind = 0; kind < 2; kind++) {
                const uint8x16_t x = src[kind], pairs = vaddq_u8(x, vextq_u8(x, x, 4)); /* s_i + s_{i+1} */
                const uint64x2_t x64 = vreinterpretq_u64_u8(x), pairs64 = vreinterpretq_u64_u8(pairs);
                p[f][kind] = vreinterpretq_u8_u64(vzip1q_u64(x64, pairs64)); /* s0, s1, s0 + s1, (unread) */
                q[f][kind] = vreinterpretq_u8_u64(vzip2q_u64(x64, pairs64)); /* s2, s3, s2 + s3, (unread) */
            }
        }
        for (int b = 0; b < 4; b++) { /* the 64 bytes of slot b: (f, kind) at 16 (2f + kind) */
            uint8x16x4_t t;
            for (int i = 0; i < 4; i++)
                t.val[i] = vaddq_u8(vqtbl1q_u8(p[i / 2][i % 2], pick[b][0]), vqtbl1q_u8(q[i / 2][i % 2], pick[b][1]));
            vst1q_u8_x4(lut + ks * ULB_LUT1_STEP_BYTES + 64 * b, t);
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
    const uint8x16_t low = vdupq_n_u8(15);
    const int8x16_t sixteen = vdupq_n_s8(16);
    for (int i = 0; i < nt * ULB_TILE; i++) acc[i] = 0;
    for (int64_t c0 = 0; c0 < steps; c0 += CHUNK) {
        const int64_t c1 = c0 + CHUNK < steps ? c0 + CHUNK : steps;
        int16x8_t sum[ULB_PANEL_TILES][2];
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) sum[t][0] = sum[t][1] = vdupq_n_s16(0);
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
                    uint8x16_t l = vdupq_n_u8(0), hu = vdupq_n_u8(0);
#pragma GCC unroll 2
                    for (int j = 0; j < 2; j++) {
                        const uint8x16_t lo = vandq_u8(s[j], low), hi = vshrq_n_u8(s[j], 4);
                        l = vaddq_u8(l, vaddq_u8(vqtbl1q_u8(tj[j]->val[0], lo), vqtbl1q_u8(tj[j]->val[2], hi)));
                        hu = vaddq_u8(hu, vaddq_u8(vqtbl1q_u8(tj[j]->val[1], lo), vqtbl1q_u8(tj[j]->val[3], hi)));
                    }
                    /* L unsigned, H signed, their sum modulo 2^16 (exact: it fits) */
                    const int8x16_t hh = vreinterpretq_s8_u8(hu);
                    const uint16x8_t s0 = vaddw_u8(vreinterpretq_u16_s16(sum[t][0]), vget_low_u8(l));
                    const uint16x8_t s1 = vaddw_high_u8(vreinterpretq_u16_s16(sum[t][1]), l);
                    sum[t][0] = vmlal_s8(vreinterpretq_s16_u16(s0), vget_low_s8(hh), vget_low_s8(sixteen));
                    sum[t][1] = vmlal_high_s8(vreinterpretq_s16_u16(s1), hh, sixteen);
                }
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            int32x4x4_t o = vld1q_s32_x4(acc + ULB_TILE * t);
            o.val[0] = vaddw_s16(o.val[0], vget_low_s16(sum[t][0]));
            o.val[1] = vaddw_high_s16(o.val[1], sum[t][0]);
            o.val[2] = vaddw_s16(o.val[2], vget_low_s16(sum[t][1]));
            o.val[3] = vaddw_high_s16(o.val[3], sum[t][1]);
            vst1q_s32_x4(acc + ULB_TILE * t, o);
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
