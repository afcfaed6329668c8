/* The code fields of a tile as NEON operands, shared by the microkernels
 * (panel_neon_body.h) and the i8mm GEMM (gemm_i8mm.c), for the level
 * ULB_ARM_LEVEL the including file compiles for (0 NEON, 1 dotprod, 2 i8mm).
 *
 * A VNNI tile (layout.h) is four 16-byte quarters of 4 rows each; field f of
 * quarter byte 4i + b is the code of row i and column 4f + b. field_of gives
 * a field as small signed bytes: 2- and 4-bit codes as they are, 1-bit ones
 * by cmtst (-1 where the bit is set: a negated sum), 8-bit ones as q - 127
 * (the level of int8, in [-127, 127]) unless the i8mm instructions take the
 * byte unsigned (U8_CODES). A sum of such fields times activations is thus
 * RAW_SIGN * sum(q x) - RAW_BIAS * sum(x). */
#ifndef ULB_ARM_NEON_FIELDS_H
#define ULB_ARM_NEON_FIELDS_H

#include <arm_neon.h>

#include "../src/internal.h"

#define LVL ULB_ARM_LEVEL
#define QUARTERS 4

/* Bytes of activations per k-step (the format's tile_k), k-steps per 16-byte
 * load of them, and 16-byte registers per such load. */
#define KSTEP_BYTES(bits) (32 / (bits))
#define UNIT_STEPS(bits) ((bits) >= 4 ? (bits) / 2 : 1)
#define UNIT_REGS(bits) ((bits) == 1 ? 2 : 1)
#define FIELDS(bits) (8 / (bits))

/* acc + the dot of each 4-byte group of a with quad `lane` of x (sdot). */
#if LVL >= 1
ALWAYS_INLINE int32x4_t sdot_lane(int32x4_t acc, int8x16_t a, int8x16_t x, const int lane) {
    switch (lane) {
    case 0: return vdotq_laneq_s32(acc, a, x, 0);
    case 1: return vdotq_laneq_s32(acc, a, x, 1);
    case 2: return vdotq_laneq_s32(acc, a, x, 2);
    default: return vdotq_laneq_s32(acc, a, x, 3);
    }
}
#endif
#if LVL >= 2
/* The same with a taken unsigned (usdot). */
ALWAYS_INLINE int32x4_t usdot_lane(int32x4_t acc, uint8x16_t a, int8x16_t x, const int lane) {
    switch (lane) {
    case 0: return vusdotq_laneq_s32(acc, a, x, 0);
    case 1: return vusdotq_laneq_s32(acc, a, x, 1);
    case 2: return vusdotq_laneq_s32(acc, a, x, 2);
    default: return vusdotq_laneq_s32(acc, a, x, 3);
    }
}
#endif

/* Quad `lane` of x in all four lanes. */
ALWAYS_INLINE int8x16_t quad_dup(int8x16_t x, const int lane) {
    const int32x4_t v = vreinterpretq_s32_s8(x);
    switch (lane) {
    case 0: return vreinterpretq_s8_s32(vdupq_laneq_s32(v, 0));
    case 1: return vreinterpretq_s8_s32(vdupq_laneq_s32(v, 1));
    case 2: return vreinterpretq_s8_s32(vdupq_laneq_s32(v, 2));
    default: return vreinterpretq_s8_s32(vdupq_laneq_s32(v, 3));
    }
}

/* Whether 8-bit codes go in unsigned (usdot, usmmla), with no bias. */
#define U8_CODES(bits) (LVL >= 2 && (bits) == 8)
/* sign and bias of a raw sum of fields (the file comment). */
#define RAW_SIGN(bits) ((bits) == 1 ? -1 : 1)
#define RAW_BIAS(bits) ((bits) == 8 && !U8_CODES(bits) ? 127 : 0)

/* Field f of a quarter as signed bytes (see RAW_SIGN and RAW_BIAS); 8-bit
 * codes under U8_CODES are left as they are. */
ALWAYS_INLINE int8x16_t field_of(uint8x16_t v, const int bits, const int f) {
    switch (bits) {
    case 1: return vreinterpretq_s8_u8(vtstq_u8(v, vdupq_n_u8((uint8_t)(1u << f))));
    case 2:
        if (f == 3) return vreinterpretq_s8_u8(vshrq_n_u8(v, 6));
        return vreinterpretq_s8_u8(vandq_u8(f == 0 ? v : f == 1 ? vshrq_n_u8(v, 2) : vshrq_n_u8(v, 4), vdupq_n_u8(3)));
    case 4: return vreinterpretq_s8_u8(f ? vshrq_n_u8(v, 4) : vandq_u8(v, vdupq_n_u8(15)));
    default: return vreinterpretq_s8_u8(U8_CODES(bits) ? v : vsubq_u8(v, vdupq_n_u8(127)));
    }
}

ALWAYS_INLINE void fields_of(uint8x16_t v, const int bits, int8x16_t *a) {
#pragma GCC unroll 8
    for (int f = 0; f < FIELDS(bits); f++) a[f] = field_of(v, bits, f);
}

/* acc + the dots of the fields a[0 .. nf) of a quarter with the quads q0 ..
 * q0 + nf - 1 of x (x[q / 4], lane q % 4). */
ALWAYS_INLINE int32x4_t quarter_dot(int32x4_t acc, const int8x16_t *a, const int nf, const int8x16_t *x,
                                    const int q0, const int bits) {
#if LVL >= 1
#pragma GCC unroll 8
    for (int f = 0; f < nf; f++) {
        const int q = q0 + f;
#if LVL >= 2
        if (U8_CODES(bits)) {
            acc = usdot_lane(acc, vreinterpretq_u8_s8(a[f]), x[q / 4], q % 4);
            continue;
        }
#endif
        acc = sdot_lane(acc, a[f], x[q / 4], q % 4);
    }
    (void)bits;
    return acc;
#else
    int16x8_t lo = vdupq_n_s16(0), hi = vdupq_n_s16(0);
#pragma GCC unroll 8
    for (int f = 0; f < nf; f++) {
        const int q = q0 + f;
        const int8x16_t xd = quad_dup(x[q / 4], q % 4);
        if (f == 0) {
            lo = vmull_s8(vget_low_s8(a[f]), vget_low_s8(xd));
            hi = vmull_high_s8(a[f], xd);
        } else {
            lo = vmlal_s8(lo, vget_low_s8(a[f]), vget_low_s8(xd));
            hi = vmlal_high_s8(hi, a[f], xd);
        }
    }
    (void)bits;
    /* byte pairs of a row, then the two pairs of each row */
    return vpadalq_s16(acc, vpaddq_s16(lo, hi));
#endif
}

/* The four quarters of a tile in VNNI order: as they are, or from a LANES
 * tile (byte 16b + l, layout.h) by a 4-register table lookup each. */
ALWAYS_INLINE void tile_quarters(const uint8_t *tile, const int lanes, uint8x16_t *q) {
    const uint8x16x4_t t = vld1q_u8_x4(tile);
    if (!lanes) {
#pragma GCC unroll 4
        for (int i = 0; i < QUARTERS; i++) q[i] = t.val[i];
        return;
    }
    static const uint8_t pick[QUARTERS][16] = {
        {0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51},
        {4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54, 7, 23, 39, 55},
        {8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59},
        {12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63}};
#pragma GCC unroll 4
    for (int i = 0; i < QUARTERS; i++) q[i] = vqtbl4q_u8(t, vld1q_u8(pick[i]));
}

#if LVL >= 2
/* acc + the 2x2 product of rows (a0, a1) and columns (b0, b1), each 8 bytes
 * of a and b (smmla; usmmla where 8-bit codes go in unsigned). */
ALWAYS_INLINE int32x4_t mmla(int32x4_t acc, int8x16_t a, int8x16_t b, const int bits) {
    return U8_CODES(bits) ? vusmmlaq_s32(acc, vreinterpretq_u8_s8(a), b) : vmmlaq_s32(acc, a, b);
}
#endif

#endif
