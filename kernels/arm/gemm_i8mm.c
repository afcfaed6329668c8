/* The GEMM of calls of several tokens (prefill) under i8mm: up to
 * ULB_I8MM_TOKENS tokens a panel call by smmla/usmmla, the contract of
 * ulb_gemm_kernel (internal.h), bit for bit the scalar reference.
 *
 * An mmla multiplies 2 rows by 2 tokens over 8 columns. The panel kernels
 * (panel_neon_body.h, mmla_tile) take 4 tokens a tile; with 8 (4 token
 * pairs) the same code fields serve twice as many products, and the
 * accumulators of half a tile (2 quarters x 2 row pairs x 4 token pairs) are
 * 16 registers. The activations' operands (token pair tp, columns [8c, 8c +
 * 8) of both tokens) are laid out once per block of tokens, in the thread's
 * scratch, for every panel the thread runs: each panel then loads one ready
 * 16-byte operand per mmla group instead of building it. The scratch keeps
 * the block it holds (a generation per begin, the first token, the count),
 * so a thread's panels after its first reuse it. */
#pragma GCC target("arch=armv8.2-a+dotprod+i8mm")
/* As in the panel kernels: scheduled before register allocation, the
 * fields of a whole k-step are hoisted and spill. */
#pragma GCC optimize("no-schedule-insns")
#define ULB_ARM_LEVEL 2
#include <string.h>

#include "neon_fields.h"

#define PAIRS (ULB_I8MM_TOKENS / 2)
#define HEADER_BYTES 64

typedef struct {
    uint64_t generation;
    int64_t n0;
    int nb;
    const int8_t *xq;
} block_tag;

static _Thread_local uint64_t generation;

static void i8mm_begin(const ulb_weight *w) {
    (void)w;
    generation++;
}

static void i8mm_end(void) {}

/* 8-column blocks of the operands of one group: its columns from the
 * first, zero padded to a multiple of 8 (8-bit codes' groups may hold an odd
 * number of 4-column k-steps). */
static int64_t group_blocks(const ulb_weight *w) { return (w->gsteps * ulb_tile_k(w->bits) + 7) / 8; }

static int64_t i8mm_scratch_bytes(const ulb_weight *w) {
    return HEADER_BYTES + w->n_groups * group_blocks(w) * PAIRS * 16;
}

/* ops[g][c][tp] = columns [8c, 8c + 8) of group g of tokens n0 + 2tp and n0
 * + 2tp + 1 (zeros past nb tokens and past the group), unless the scratch
 * holds them already. */
static const int8_t *block_operands(const ulb_weight *w, const ulb_acts *a, int64_t n0, int nb, uint8_t *scratch) {
    block_tag *tag = (block_tag *)scratch;
    int8_t *ops = (int8_t *)(scratch + HEADER_BYTES);
    if (tag->generation == generation && tag->n0 == n0 && tag->nb == nb && tag->xq == a->xq) return ops;
    const int64_t B = group_blocks(w), tk = ulb_tile_k(w->bits);
    memset(ops, 0, (size_t)(w->n_groups * B * PAIRS * 16));
    for (int64_t g = 0; g < w->n_groups; g++) {
        const int64_t c0 = g * w->gsteps * tk, cols = ulb_group_steps(w, g) * tk;
        for (int j = 0; j < nb; j++) {
            const int8_t *x = a->xq + (n0 + j) * a->ldq + c0;
            for (int64_t c = 0; c < B && 8 * c < cols; c++)
                memcpy(ops + ((g * B + c) * PAIRS + j / 2) * 16 + 8 * (j % 2), x + 8 * c,
                       (size_t)(cols - 8 * c < 8 ? cols - 8 * c : 8));
        }
    }
    *tag = (block_tag){generation, n0, nb, a->xq};
    return ops;
}

/* Quarters 2h and 2h + 1 of a tile in VNNI order. */
ALWAYS_INLINE void half_quarters(const uint8_t *tile, const int h, const int lanes, uint8x16_t *q) {
    if (lanes) {
        uint8x16_t all[QUARTERS];
        tile_quarters(tile, 1, all);
        q[0] = all[2 * h], q[1] = all[2 * h + 1];
        return;
    }
    q[0] = vld1q_u8(tile + 32 * h);
    q[1] = vld1q_u8(tile + 32 * h + 16);
}

/* Half h of tile t of one group (steps k-steps of nt tiles from codes,
 * operands from ops at the group's first column block), ntp token pairs:
 * acc[tp][qi][rp] as in mmla_tile. 8-bit codes take two k-steps an mmla
 * (the second zero past the group's last). */
ALWAYS_INLINE void half_tile(const uint8_t *codes, int64_t steps, const int nt, const int t, const int h,
                             const int8_t *ops, const int ntp, int32x4_t acc[PAIRS][2][2], const int bits,
                             const int lanes) {
    const int per = bits == 8 ? 2 : 1, npairs = bits == 8 ? 1 : FIELDS(bits) / 2;
    const int cols = KSTEP_BYTES(bits) / 8; /* column blocks a k-step (8-bit: a block per two) */
    for (int64_t ks = 0; ks < steps; ks += per) {
        const uint8_t *tile = codes + (ks * nt + t) * ULB_TILE_BYTES;
        uint8x16_t qv[2], qw[2] = {vdupq_n_u8(0), vdupq_n_u8(0)};
        half_quarters(tile, h, lanes, qv);
        if (bits == 8 && ks + 1 < steps) half_quarters(tile + nt * ULB_TILE_BYTES, h, lanes, qw);
        const int8_t *op = ops + (bits == 8 ? ks / 2 : ks * cols) * PAIRS * 16; /* this k-step's blocks */
#pragma GCC unroll 4
        for (int fp = 0; fp < npairs; fp++) {
            int8x16_t b[PAIRS];
#pragma GCC unroll 4
            for (int tp = 0; tp < ntp; tp++) b[tp] = vld1q_s8(op + (fp * PAIRS + tp) * 16);
#pragma GCC unroll 2
            for (int qi = 0; qi < 2; qi++) {
                const int8x16_t f0 = field_of(qv[qi], bits, bits == 8 ? 0 : 2 * fp);
                const int8x16_t f1 = bits == 8 ? vreinterpretq_s8_u8(qw[qi]) : field_of(qv[qi], bits, 2 * fp + 1);
                const int32x4_t z0 = vreinterpretq_s32_s8(f0), z1 = vreinterpretq_s32_s8(f1);
                const int8x16_t r01 = vreinterpretq_s8_s32(vzip1q_s32(z0, z1));
                const int8x16_t r23 = vreinterpretq_s8_s32(vzip2q_s32(z0, z1));
#pragma GCC unroll 4
                for (int tp = 0; tp < ntp; tp++) {
                    acc[tp][qi][0] = mmla(acc[tp][qi][0], r01, b[tp], bits);
                    acc[tp][qi][1] = mmla(acc[tp][qi][1], r23, b[tp], bits);
                }
            }
        }
    }
}

ALWAYS_INLINE void panel_bits(const ulb_weight *w, int64_t p, const ulb_acts *a, int64_t n0, int nb,
                              const int8_t *ops, float *facc, int32_t *dots, const int ntp, const int bits,
                              const int lanes) {
    const int nt = ulb_panel_ntiles(w->M_pad, p);
    const int64_t G = w->n_groups, B = group_blocks(w);
    const int32_t ca = w->level_a * RAW_SIGN(bits), cb_unit = w->level_a * RAW_BIAS(bits) + w->level_b;
    for (int t = 0; t < nt; t++)
        for (int h = 0; h < 2; h++)
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *group = ulb_group_base(w, p, nt, g);
                const float *scales = (const float *)group;
                int32x4_t acc[PAIRS][2][2];
#pragma GCC unroll 4
                for (int tp = 0; tp < ntp; tp++)
                    acc[tp][0][0] = acc[tp][0][1] = acc[tp][1][0] = acc[tp][1][1] = vdupq_n_s32(0);
                half_tile(group + nt * ULB_TILE_SCALE_BYTES, ulb_group_steps(w, g), nt, t, h,
                          ops + g * B * PAIRS * 16, ntp, acc, bits, lanes);
                for (int j = 0; j < nb; j++) {
                    const int tp = j / 2;
                    const int32x4_t vb = vdupq_n_s32(cb_unit * a->xsum[(n0 + j) * G + g]);
                    for (int qi = 0; qi < 2; qi++) {
                        const int32x4_t raw = j % 2 ? vuzp2q_s32(acc[tp][qi][0], acc[tp][qi][1])
                                                    : vuzp1q_s32(acc[tp][qi][0], acc[tp][qi][1]);
                        const int32x4_t dot = vmlaq_n_s32(vb, raw, ca);
                        const int64_t r = t * ULB_TILE + 4 * (2 * h + qi); /* row within the panel */
                        float *f = facc + j * ULB_PANEL_ROWS + r;
                        vst1q_f32(f, vaddq_f32(vld1q_f32(f), vmulq_f32(vld1q_f32(scales + r), vcvtq_f32_s32(dot))));
                        if (dots) vst1q_s32(dots + (j * G + g) * ULB_PANEL_ROWS + r, dot);
                    }
                }
            }
}

/* panel_bits with the code width and tile order fixed, for the call's token pairs. */
#define ULB_I8MM_WIDTH(NAME, BITS, LANES)                                                          \
    static void NAME(const ulb_weight *w, int64_t p, const ulb_acts *a, int64_t n0, int nb, const int8_t *ops, \
                     float *facc, int32_t *dots) {                                                 \
        switch ((nb + 1) / 2) {                                                                    \
        case 1: panel_bits(w, p, a, n0, nb, ops, facc, dots, 1, BITS, LANES); return;              \
        case 2: panel_bits(w, p, a, n0, nb, ops, facc, dots, 2, BITS, LANES); return;              \
        case 3: panel_bits(w, p, a, n0, nb, ops, facc, dots, 3, BITS, LANES); return;              \
        default: panel_bits(w, p, a, n0, nb, ops, facc, dots, 4, BITS, LANES); return;             \
        }                                                                                          \
    }
ULB_I8MM_WIDTH(panel_1bit_vnni, 1, 0)
ULB_I8MM_WIDTH(panel_1bit_lanes, 1, 1)
ULB_I8MM_WIDTH(panel_2bit, 2, 0)
ULB_I8MM_WIDTH(panel_4bit, 4, 0)
ULB_I8MM_WIDTH(panel_8bit, 8, 0)

static void i8mm_panel(const ulb_weight *w, int64_t p, const ulb_acts *a, int64_t n0, int nb, uint8_t *scratch,
                       float *facc, int32_t *dots) {
    const int8_t *ops = block_operands(w, a, n0, nb, scratch);
    for (int j = 0; j < nb; j++)
        memset(facc + j * ULB_PANEL_ROWS, 0, (size_t)ulb_panel_ntiles(w->M_pad, p) * ULB_TILE * sizeof(float));
    switch (w->bits) {
    case 1:
        (w->tiles == ULB_TILES_LANES ? panel_1bit_lanes : panel_1bit_vnni)(w, p, a, n0, nb, ops, facc, dots);
        return;
    case 2: panel_2bit(w, p, a, n0, nb, ops, facc, dots); return;
    case 4: panel_4bit(w, p, a, n0, nb, ops, facc, dots); return;
    default: panel_8bit(w, p, a, n0, nb, ops, facc, dots); return;
    }
}

const ulb_gemm_kernel ulb_gemm_i8mm = {ULB_I8MM_TOKENS, 1, 0, i8mm_scratch_bytes, i8mm_begin, i8mm_end, i8mm_panel};
