/* Body of the AArch64 microkernels (1-, 2-, 4- and 8-bit codes), compiled
 * three times, each file under its own target, which names the entry point
 * ULB_PANEL_ARM_FN:
 *   panel_neon.c    ULB_ARM_LEVEL 0  ARMv8.0 NEON: the dot products from
 *                                    smull/smlal in 16 bits, pairwise into 32;
 *   panel_dotprod.c ULB_ARM_LEVEL 1  FEAT_DotProd: sdot by element;
 *   panel_i8mm.c    ULB_ARM_LEVEL 2  FEAT_I8MM as well: usdot for 8-bit
 *                                    codes, smmla/usmmla for several tokens.
 * Same contract as every ISA (internal.h), bit for bit the scalar reference.
 *
 * Field f of a quarter of a VNNI tile (neon_fields.h) against the 4
 * activations of k-quad f, broadcast from one 32-bit lane, is one sdot: 4
 * rows, 16 weights. Each path's raw integer sum is sign * sum(q x) - bias *
 * sum(x) (RAW_SIGN, RAW_BIAS), and the epilogue's ca * raw + cb * xsum gives
 * level_a * sum(q x) + level_b * xsum exactly.
 * In 16 bits (level 0) a quarter's fields add at most 8 * 128 (1 bit),
 * 4 * 3 * 128 (2), 2 * 15 * 128 (4) or 127 * 128 (8) per byte, so a pair of
 * bytes stays within int16 before it widens.
 *
 * One token reads each panel in address order, every tile of a k-step in
 * turn, one accumulator per quarter (16); 2-bit codes under dotprod take the
 * path of one_token_2bit instead. Several tokens (2-4) take one tile at a
 * time, each code field extracted once for all of them. LANES tiles (1-bit
 * codes) are turned into VNNI order with four table lookups per tile; the
 * 1-bit lookup kernel (lut1_neon.c) serves one token where linear.c hands
 * it tables. */
#include <string.h>

#include "neon_fields.h"

/* The activations of k-steps [ks, ks + n) of one token (x at the group's
 * first column) in UNIT_REGS registers: loaded whole when n is a full unit,
 * else copied, zero padded, so that nothing past the group is read. */
ALWAYS_INLINE void load_unit(const int8_t *x, int64_t ks, const int n, const int bits, int8x16_t *out) {
    const int tk = KSTEP_BYTES(bits);
    if (n == UNIT_STEPS(bits)) {
        for (int r = 0; r < UNIT_REGS(bits); r++) out[r] = vld1q_s8(x + ks * tk + 16 * r);
        return;
    }
    int8_t buf[32] = {0};
    memcpy(buf, x + ks * tk, (size_t)(n * tk));
    for (int r = 0; r < UNIT_REGS(bits); r++) out[r] = vld1q_s8(buf + 16 * r);
}

/* Prefetch the nlines 64-byte lines from p, dist bytes ahead. */
ALWAYS_INLINE void prefetch_lines(const uint8_t *p, const int nlines, int64_t dist) {
#pragma GCC unroll 4
    for (int i = 0; i < nlines; i++) __builtin_prefetch(p + dist + 64 * i, 0, 2);
}

/* How many of the k-steps [0, steps) of a group whose codes start at
 * `codes` (nt tiles a k-step) may prefetch: the first ones, whose lines all
 * lie `dist` or more before the end of the calling thread's panels
 * (ulb_prefetch_ahead's bound, checked once a group rather than once a
 * line). The rest run without prefetch. */
static inline int64_t prefetch_steps(const uint8_t *codes, int64_t steps, int nt, int64_t dist, const uint8_t *end) {
    if (!dist) return 0;
    const int64_t room = (int64_t)(end - codes) - dist + 63, step = (int64_t)nt * ULB_TILE_BYTES;
    const int64_t n = room < 0 ? 0 : room / step;
    return n < steps ? n : steps;
}

/* One unit of n k-steps from ks (n <= UNIT_STEPS), tiles [t0, t0 + tc) of
 * nt, nb tokens: raw[j][t][q] += the quarter dots. pf: prefetch every line. */
ALWAYS_INLINE void generic_unit(const uint8_t *codes, int64_t ks, const int n, const int nt, const int t0,
                                const int tc, const int8_t *const *x, const int nb, int64_t dist, const int pf,
                                int32x4_t raw[][ULB_PANEL_TILES][QUARTERS], const int bits, const int lanes) {
    int8x16_t xr[ULB_NB_MAX][2];
#pragma GCC unroll 4
    for (int j = 0; j < nb; j++) load_unit(x[j], ks, n, bits, xr[j]);
#pragma GCC unroll 4
    for (int u = 0; u < n; u++) {
        const uint8_t *step = codes + (ks + u) * nt * ULB_TILE_BYTES;
        if (pf) prefetch_lines(step + t0 * ULB_TILE_BYTES, tc, dist);
#pragma GCC unroll 4
        for (int t = 0; t < tc; t++) {
            uint8x16_t qv[QUARTERS];
            tile_quarters(step + (t0 + t) * ULB_TILE_BYTES, lanes, qv);
#pragma GCC unroll 4
            for (int q = 0; q < QUARTERS; q++) {
                int8x16_t a[8];
                fields_of(qv[q], bits, a);
#pragma GCC unroll 4
                for (int j = 0; j < nb; j++)
                    raw[j][t][q] = quarter_dot(raw[j][t][q], a, FIELDS(bits), xr[j], u * FIELDS(bits), bits);
            }
        }
    }
}

/* K-steps [k0, k1) through generic_unit, whole units and then the rest. */
ALWAYS_INLINE void generic_run(const uint8_t *codes, int64_t k0, int64_t k1, const int nt, const int t0,
                               const int tc, const int8_t *const *x, const int nb, int64_t dist, const int pf,
                               int32x4_t raw[][ULB_PANEL_TILES][QUARTERS], const int bits, const int lanes) {
    const int U = UNIT_STEPS(bits);
    int64_t ks = k0;
    for (; ks + U <= k1; ks += U) generic_unit(codes, ks, U, nt, t0, tc, x, nb, dist, pf, raw, bits, lanes);
    switch (k1 - ks) { /* fewer than U left: only where U > 1 */
    case 1: generic_unit(codes, ks, 1, nt, t0, tc, x, nb, dist, pf, raw, bits, lanes); break;
    case 2: if (U > 2) generic_unit(codes, ks, 2, nt, t0, tc, x, nb, dist, pf, raw, bits, lanes); break;
    case 3: if (U > 3) generic_unit(codes, ks, 3, nt, t0, tc, x, nb, dist, pf, raw, bits, lanes); break;
    default: break;
    }
}

#if LVL >= 1
/* One token, 2-bit codes: the fields masked in place, v & 3 and v >> 6 at
 * their value, v & 0x0C at 4 times it and v & 0x30 at 16 times it, each
 * scale summed apart (a, b, c) and shifted back exactly (a multiple of 4 or
 * 16) at the end: 4 operations per quarter for the fields instead of 6. Three
 * accumulators per quarter are more than 16 quarters' worth of registers, so
 * the loop runs tile by tile over chunks of CHUNK_2BIT k-steps (sums kept
 * on the stack between chunks), each chunk 16 KiB of a full panel's stream;
 * unrolled, the tile loop takes 36 or 37 instructions per tile and k-step. */
#define CHUNK_2BIT 64
ALWAYS_INLINE void chunk_2bit(const uint8_t *codes, int64_t k0, int64_t k1, const int nt, int t, const int8_t *x,
                              int64_t dist, const int pf, int32x4_t *s, const int lanes) {
    int32x4_t a[QUARTERS], b[QUARTERS], c[QUARTERS];
#pragma GCC unroll 4
    for (int q = 0; q < QUARTERS; q++) a[q] = s[q], b[q] = s[4 + q], c[q] = s[8 + q];
    const uint8x16_t m0 = vdupq_n_u8(0x03), m1 = vdupq_n_u8(0x0C), m2 = vdupq_n_u8(0x30);
    const int64_t stride = nt * ULB_TILE_BYTES, ahead = dist - stride;
    const uint8_t *tile = codes + (k0 * nt + t) * ULB_TILE_BYTES;
    const int8_t *xs = x + k0 * 16;
#pragma GCC unroll 8
    for (int64_t n = k1 - k0; n > 0; n--) {
        uint8x16_t qv[QUARTERS];
        tile_quarters(tile, lanes, qv);
        tile += stride; /* the loads' post-increment */
        if (pf) __builtin_prefetch(tile + ahead, 0, 2);
        const int8x16_t xk = vld1q_s8(xs);
        xs += 16;
#pragma GCC unroll 4
        for (int q = 0; q < QUARTERS; q++) {
            a[q] = vdotq_laneq_s32(a[q], vreinterpretq_s8_u8(vandq_u8(qv[q], m0)), xk, 0);
            b[q] = vdotq_laneq_s32(b[q], vreinterpretq_s8_u8(vandq_u8(qv[q], m1)), xk, 1);
            c[q] = vdotq_laneq_s32(c[q], vreinterpretq_s8_u8(vandq_u8(qv[q], m2)), xk, 2);
            a[q] = vdotq_laneq_s32(a[q], vreinterpretq_s8_u8(vshrq_n_u8(qv[q], 6)), xk, 3);
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < QUARTERS; q++) s[q] = a[q], s[4 + q] = b[q], s[8 + q] = c[q];
}

ALWAYS_INLINE void one_token_2bit(const uint8_t *codes, int64_t steps, int64_t pf_steps, const int nt,
                                  const int8_t *x, int64_t dist, int32x4_t raw[][ULB_PANEL_TILES][QUARTERS],
                                  const int lanes) {
    int32x4_t s[ULB_PANEL_TILES][3 * QUARTERS];
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
        for (int i = 0; i < 3 * QUARTERS; i++) s[t][i] = vdupq_n_s32(0);
    for (int64_t c0 = 0; c0 < steps; c0 += CHUNK_2BIT) {
        const int64_t c1 = c0 + CHUNK_2BIT < steps ? c0 + CHUNK_2BIT : steps;
        const int64_t cp = pf_steps < c0 ? c0 : pf_steps < c1 ? pf_steps : c1; /* prefetch in [c0, cp) */
        for (int t = 0; t < nt; t++) {
            if (cp > c0) chunk_2bit(codes, c0, cp, nt, t, x, dist, 1, s[t], lanes);
            if (c1 > cp) chunk_2bit(codes, cp, c1, nt, t, x, dist, 0, s[t], lanes);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int q = 0; q < QUARTERS; q++)
            raw[0][t][q] = vsraq_n_s32(vsraq_n_s32(s[t][q], s[t][4 + q], 2), s[t][8 + q], 4);
}
#endif

#if LVL >= 2
/* Several tokens by 2x8 by 8x2 matrix products (smmla; usmmla for 8-bit
 * codes, taken unsigned): two fields f, f + 1 of a quarter zipped by 32-bit
 * lanes are rows (0, 1) and (2, 3) of it over 8 consecutive columns, the
 * 8 activations of those columns of two tokens one 16-byte operand, and the
 * product their 2x2 dots. 8-bit codes pair the field of two k-steps. Per
 * token pair tp, quarter q and row pair rp: acc = (r0 t0, r0 t1, r1 t0,
 * r1 t1); the pair's two tokens come apart with uzp at the end. An odd last
 * token runs beside a zero one. */
/* The mmla operands of one k-step (8-bit codes: of two, `two` of them
 * there) of tokens x0 and x1 (x at the group's first column; partner 0: x1
 * is a zero token): b[fp] = the activations of columns [8 fp, 8 fp + 8) of
 * x0, then of x1. */
ALWAYS_INLINE void pair_operands(const int8_t *x0, const int8_t *x1, const int partner, int64_t ks, const int two,
                                 const int bits, int8x16_t *b) {
    const int tk = KSTEP_BYTES(bits);
    if (bits <= 2) { /* 16 bytes a field pair of two: zip the 64-bit halves */
        for (int r = 0; r < UNIT_REGS(bits); r++) {
            const int64x2_t v0 = vreinterpretq_s64_s8(vld1q_s8(x0 + ks * tk + 16 * r));
            const int64x2_t v1 = partner ? vreinterpretq_s64_s8(vld1q_s8(x1 + ks * tk + 16 * r)) : vdupq_n_s64(0);
            b[2 * r] = vreinterpretq_s8_s64(vzip1q_s64(v0, v1));
            b[2 * r + 1] = vreinterpretq_s8_s64(vzip2q_s64(v0, v1));
        }
        return;
    }
    if (bits == 8 && !two) { /* the group's last k-step alone: 4 bytes each */
        int32_t w0, w1 = 0;
        memcpy(&w0, x0 + ks * tk, 4);
        if (partner) memcpy(&w1, x1 + ks * tk, 4);
        b[0] = vreinterpretq_s8_s32(vsetq_lane_s32(w1, vsetq_lane_s32(w0, vdupq_n_s32(0), 0), 2));
        return;
    }
    const int64x2_t v0 = vcombine_s64(vld1_s64((const int64_t *)(x0 + ks * tk)), vdup_n_s64(0));
    b[0] = vreinterpretq_s8_s64(partner ? vld1q_lane_s64((const int64_t *)(x1 + ks * tk), v0, 1) : v0);
}

/* K-steps [k0, k1) of tile t0, nb tokens (2-4) into acc; 8-bit codes two
 * k-steps at a time, the last alone where k1 - k0 is odd. */
ALWAYS_INLINE void mmla_run(const uint8_t *codes, int64_t k0, int64_t k1, const int nt, const int t0,
                            const int8_t *const *x, const int nb, int64_t dist, const int pf,
                            int32x4_t acc[2][QUARTERS][2], const int bits, const int lanes) {
    const int ntp = (nb + 1) / 2, per = bits == 8 ? 2 : 1;
    const int npairs = bits == 8 ? 1 : FIELDS(bits) / 2;
    for (int64_t ks = k0; ks < k1; ks += per) {
        const int two = bits == 8 && ks + 1 < k1; /* 8-bit: a second k-step in this pair */
        const uint8_t *tile = codes + (ks * nt + t0) * ULB_TILE_BYTES;
        if (pf) __builtin_prefetch(tile + dist, 0, 2);
        uint8x16_t qv[QUARTERS], qw[QUARTERS];
        tile_quarters(tile, lanes, qv);
        if (bits == 8) {
            if (two) {
                tile_quarters(tile + nt * ULB_TILE_BYTES, lanes, qw);
                if (pf) __builtin_prefetch(tile + nt * ULB_TILE_BYTES + dist, 0, 2);
            } else {
#pragma GCC unroll 4
                for (int q = 0; q < QUARTERS; q++) qw[q] = vdupq_n_u8(0);
            }
        }
        int8x16_t b[2][4];
#pragma GCC unroll 2
        for (int tp = 0; tp < ntp; tp++) {
            const int partner = 2 * tp + 1 < nb;
            pair_operands(x[2 * tp], x[2 * tp + partner], partner, ks, two, bits, b[tp]);
        }
#pragma GCC unroll 4
        for (int fp = 0; fp < npairs; fp++) {
#pragma GCC unroll 4
            for (int q = 0; q < QUARTERS; q++) {
                /* 8-bit: a zero second k-step stays zero (usmmla takes the codes as they are) */
                const int8x16_t f0 = field_of(qv[q], bits, bits == 8 ? 0 : 2 * fp);
                const int8x16_t f1 = bits == 8 ? vreinterpretq_s8_u8(qw[q]) : field_of(qv[q], bits, 2 * fp + 1);
                const int32x4_t z0 = vreinterpretq_s32_s8(f0), z1 = vreinterpretq_s32_s8(f1);
                const int8x16_t r01 = vreinterpretq_s8_s32(vzip1q_s32(z0, z1));
                const int8x16_t r23 = vreinterpretq_s8_s32(vzip2q_s32(z0, z1));
#pragma GCC unroll 2
                for (int tp = 0; tp < ntp; tp++) {
                    acc[tp][q][0] = mmla(acc[tp][q][0], r01, b[tp][fp], bits);
                    acc[tp][q][1] = mmla(acc[tp][q][1], r23, b[tp][fp], bits);
                }
            }
        }
    }
}

ALWAYS_INLINE void mmla_tile(const uint8_t *codes, int64_t steps, int64_t pf_steps, const int nt, const int t0,
                             const int8_t *const *x, const int nb, int64_t dist,
                             int32x4_t raw[][ULB_PANEL_TILES][QUARTERS], const int bits, const int lanes) {
    int32x4_t acc[2][QUARTERS][2];
#pragma GCC unroll 2
    for (int tp = 0; tp < 2; tp++)
#pragma GCC unroll 4
        for (int q = 0; q < QUARTERS; q++) acc[tp][q][0] = acc[tp][q][1] = vdupq_n_s32(0);
    /* 8-bit codes pair k-steps: the prefetched run ends on an even one */
    const int64_t split = bits == 8 ? pf_steps & ~(int64_t)1 : pf_steps;
    if (split > 0) mmla_run(codes, 0, split, nt, t0, x, nb, dist, 1, acc, bits, lanes);
    if (steps > split) mmla_run(codes, split, steps, nt, t0, x, nb, dist, 0, acc, bits, lanes);
#pragma GCC unroll 4
    for (int j = 0; j < nb; j++) {
        const int tp = j / 2;
#pragma GCC unroll 4
        for (int q = 0; q < QUARTERS; q++)
            raw[j][0][q] = j % 2 ? vuzp2q_s32(acc[tp][q][0], acc[tp][q][1]) : vuzp1q_s32(acc[tp][q][0], acc[tp][q][1]);
    }
}
#endif

/* Tiles [t0, t0 + tc) of panel p (nt tiles a k-step), nb tokens from n0, into
 * facc (and dots): the contract of ulb_panel_fn for those rows. One token
 * takes all tiles at once (tc = nt), several one tile at a time (tc = 1). */
ALWAYS_INLINE void tiles_body(const ulb_weight *w, int64_t p, const int nt, const int t0, const int tc,
                              const ulb_acts *a, int64_t n0, float *facc, int32_t *dots, const int nb,
                              const int bits, const int lanes) {
    const int tk = KSTEP_BYTES(bits), U = UNIT_STEPS(bits);
    const int64_t dist = a->prefetch_dist, G = w->n_groups;
    const int lut = bits == 1 && nb == 1 && a->lut1 != NULL;
#pragma GCC unroll 4
    for (int j = 0; j < nb; j++)
        for (int r = 0; r < tc * ULB_TILE; r += 4)
            vst1q_f32(facc + j * ULB_PANEL_ROWS + t0 * ULB_TILE + r, vdupq_n_f32(0));
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *group = ulb_group_base(w, p, nt, g);
        const float *scales = (const float *)group;
        const uint8_t *codes = group + nt * ULB_TILE_SCALE_BYTES;
        const int64_t ks0 = g * w->gsteps, steps = ulb_group_steps(w, g);
        const int64_t pf_steps = prefetch_steps(codes, steps, nt, dist, a->prefetch_end);
        /* As far ahead of the scales as the loops prefetch ahead of codes. */
        if (t0 == 0)
            for (int t = 0; t < nt; t++) ulb_prefetch_ahead(group + t * ULB_TILE_SCALE_BYTES, dist, a->prefetch_end);
        const int8_t *x[ULB_NB_MAX];
#pragma GCC unroll 4
        for (int j = 0; j < nb; j++) x[j] = a->xq + (n0 + j) * a->ldq + ks0 * tk;
        int32x4_t raw[ULB_NB_MAX][ULB_PANEL_TILES][QUARTERS];
#pragma GCC unroll 4
        for (int j = 0; j < nb; j++)
#pragma GCC unroll 4
            for (int t = 0; t < tc; t++)
#pragma GCC unroll 4
                for (int q = 0; q < QUARTERS; q++) raw[j][t][q] = vdupq_n_s32(0);
        /* raw = sign * sum(q x) - bias * xsum (file comment) */
        int sign = RAW_SIGN(bits), bias = RAW_BIAS(bits);
        if (lut) {
            int32_t dot1[ULB_PANEL_ROWS];
            ulb_lut1_group_neon(codes, steps, pf_steps, nt, lanes,
                                a->lut1 + (n0 * w->ksteps + ks0) * ULB_LUT1_STEP_BYTES, dist, dot1);
#pragma GCC unroll 4
            for (int t = 0; t < tc; t++)
#pragma GCC unroll 4
                for (int q = 0; q < QUARTERS; q++) raw[0][t][q] = vld1q_s32(dot1 + ULB_TILE * t + 4 * q);
            sign = 1, bias = 0;
        }
#if LVL >= 1
        else if (bits == 2 && nb == 1) {
            one_token_2bit(codes, steps, pf_steps, nt, x[0], dist, raw, lanes);
        }
#endif
#if LVL >= 2
        else if (nb > 1) {
            mmla_tile(codes, steps, pf_steps, nt, t0, x, nb, dist, raw, bits, lanes);
        }
#endif
        else {
            const int64_t split = pf_steps / U * U; /* the prefetched run in whole units */
            if (split > 0) generic_run(codes, 0, split, nt, t0, tc, x, nb, dist, 1, raw, bits, lanes);
            if (steps > split) generic_run(codes, split, steps, nt, t0, tc, x, nb, dist, 0, raw, bits, lanes);
        }
        const int32_t ca = w->level_a * sign, cb = w->level_a * bias + w->level_b;
#pragma GCC unroll 4
        for (int j = 0; j < nb; j++) {
            const int32x4_t vb = vdupq_n_s32(cb * a->xsum[(n0 + j) * G + g]);
#pragma GCC unroll 4
            for (int t = 0; t < tc; t++)
#pragma GCC unroll 4
                for (int q = 0; q < QUARTERS; q++) {
                    const int64_t r = (t0 + t) * ULB_TILE + 4 * q; /* row within the panel */
                    const int32x4_t dot = vmlaq_n_s32(vb, raw[j][t][q], ca);
                    float *f = facc + j * ULB_PANEL_ROWS + r;
                    vst1q_f32(f, vaddq_f32(vld1q_f32(f), vmulq_f32(vld1q_f32(scales + r), vcvtq_f32_s32(dot))));
                    if (dots) vst1q_s32(dots + (j * G + g) * ULB_PANEL_ROWS + r, dot);
                }
        }
    }
}

#define ULB_ARM_ONE_TOKEN(NT)                                                                      \
    case NT: tiles_body(w, p, NT, 0, NT, a, n0, facc, dots, 1, bits, lanes); return;

/* Token n0 through all tiles of panel p. */
ALWAYS_INLINE void one_token(const ulb_weight *w, int64_t p, int ntiles, const ulb_acts *a, int64_t n0, float *facc,
                             int32_t *dots, const int bits, const int lanes) {
    switch (ntiles) { ULB_ARM_ONE_TOKEN(1) ULB_ARM_ONE_TOKEN(2) ULB_ARM_ONE_TOKEN(3) ULB_ARM_ONE_TOKEN(4) }
}

#define ULB_ARM_TOKENS(NB)                                                                         \
    case NB:                                                                                       \
        for (int t = 0; t < ntiles; t++) tiles_body(w, p, ntiles, t, 1, a, n0, facc, dots, NB, bits, lanes); \
        return;

ALWAYS_INLINE void panel_bits(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0,
                              int nb, float *facc, int32_t *dots, const int bits, const int lanes) {
    const int64_t p = tile0 / ULB_PANEL_TILES;
    /* Several tokens with tables: a lookup pass each (the codes come from cache after the first). */
    if (nb == 1 || (bits == 1 && a->lut1)) {
        for (int j = 0; j < nb; j++)
            one_token(w, p, ntiles, a, n0 + j, facc + j * ULB_PANEL_ROWS,
                      dots ? dots + j * w->n_groups * ULB_PANEL_ROWS : NULL, bits, lanes);
        return;
    }
    switch (nb) { ULB_ARM_TOKENS(2) ULB_ARM_TOKENS(3) ULB_ARM_TOKENS(4) }
}

#define ULB_ARM_PANEL_FN(NAME, BITS, LANES)                                                        \
    static void NAME(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, \
                     int nb, float *facc, int32_t *dots) {                                         \
        panel_bits(w, tile0, ntiles, a, n0, nb, facc, dots, BITS, LANES);                          \
    }
ULB_ARM_PANEL_FN(panel_1bit_vnni, 1, 0)
ULB_ARM_PANEL_FN(panel_1bit_lanes, 1, 1)
ULB_ARM_PANEL_FN(panel_2bit, 2, 0)
ULB_ARM_PANEL_FN(panel_4bit, 4, 0)
ULB_ARM_PANEL_FN(panel_8bit, 8, 0)

static void panel_1bit(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb,
                       float *facc, int32_t *dots) {
    (w->tiles == ULB_TILES_LANES ? panel_1bit_lanes : panel_1bit_vnni)(w, tile0, ntiles, a, n0, nb, facc, dots);
}

ULB_PANEL_BY_WIDTH(ULB_PANEL_ARM_FN)
