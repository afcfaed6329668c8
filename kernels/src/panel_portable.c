/* Portable microkernel: plain C11 that compilers vectorise for the vector
 * unit they target (NEON, SSE2, ...), for CPUs without one of the kernels of
 * x86/ ("portable" ISA, the default there). Same contract as every ISA
 * (internal.h): bit for bit the scalar reference.
 *
 * Where the reference fetches one code at a time through layout.h, this
 * walks a group's code stream in address order and treats each 64-byte tile
 * as 64 lanes: lane 4l + b of field f holds the code of row l, column 4f + b
 * (layout.h), so a field times the four activations of its k-quad, repeated
 * every 4 lanes, is one lane-wise multiply; the loops run over 8 lanes at
 * a time against an 8-lane copy of those activations (a 64-lane copy per
 * field was far slower).
 * Lanes sum per k-step in int16 (|sum| <= 254 * 128 for 8-bit codes' one
 * field, 4 * 3 * 128 for 2-bit's four) and per group in int32; the four
 * lanes of a row add at the group's end. */
#include <string.h>

#include "lanes_out.h"

#define LANES ULB_TILE_BYTES
#define PAT 8
/* GCC 12 vectorises the loop over a tile's lanes with up to 4 fields inside
 * (2-bit codes), not 8 (1-bit codes): those take two passes of 4, unrolled
 * (left as a loop, the two passes kept 1-bit codes scalar). */
#define FIELDS_AT_ONCE 4

/* A tile of order `tiles` in VNNI order: as it is, or a LANES tile
 * (layout.h) transposed into buf. */
ALWAYS_INLINE const uint8_t *vnni_tile(const uint8_t *tile, const int tiles, uint8_t buf[LANES]) {
    if (tiles == ULB_TILES_VNNI) return tile;
    for (int l = 0; l < ULB_TILE; l++)
        for (int b = 0; b < 4; b++) buf[4 * l + b] = tile[ulb_tile_byte(ULB_TILES_LANES, l, b)];
    return buf;
}

/* lanes[t][q] += sum over fields of code(t, q, field) * x[4 * field + q % 4]
 * for the k-steps [0, steps) of one group, codes at `codes`, x at its first
 * column. Inlined per code width, so that the fields, shifts and masks are
 * constants and the lane loops vectorise. */
ALWAYS_INLINE void group_lanes(const uint8_t *codes, int64_t steps, int nt, const int bits, const int tiles,
                               const int8_t *x, int32_t lanes[ULB_PANEL_TILES][LANES]) {
    const int fields = 8 / bits, tk = 32 / bits;
    const unsigned mask = bits == 8 ? 0xffu : (1u << bits) - 1u;
    int16_t xrep[8][PAT]; /* field f's four activations, twice: the pattern of 8 lanes (two rows) */
    for (int64_t i = 0; i < steps; i++, x += tk) {
        for (int f = 0; f < fields; f++)
            for (int u = 0; u < PAT; u++) xrep[f][u] = x[4 * f + u % 4];
        for (int t = 0; t < nt; t++) {
            uint8_t buf[LANES];
            const uint8_t *tile = vnni_tile(codes + (i * nt + t) * LANES, tiles, buf);
            for (int q0 = 0; q0 < LANES; q0 += PAT)
#pragma GCC unroll 2
                for (int f0 = 0; f0 < fields; f0 += FIELDS_AT_ONCE) {
                    const int nf = fields - f0 < FIELDS_AT_ONCE ? fields - f0 : FIELDS_AT_ONCE;
                    int16_t sum[PAT];
                    for (int u = 0; u < PAT; u++)
                        sum[u] = (int16_t)((tile[q0 + u] >> (bits * f0)) & mask) * xrep[f0][u];
                    for (int f = f0 + 1; f < f0 + nf; f++)
                        for (int u = 0; u < PAT; u++)
                            sum[u] += (int16_t)((tile[q0 + u] >> (bits * f)) & mask) * xrep[f][u];
                    for (int u = 0; u < PAT; u++) lanes[t][q0 + u] += sum[u];
                }
        }
    }
}

static void group_lanes_of_width(const uint8_t *codes, int64_t steps, int nt, int bits, int tiles,
                                 const int8_t *x, int32_t lanes[ULB_PANEL_TILES][LANES]) {
    switch (bits) {
    case 1:
        if (tiles == ULB_TILES_LANES)
            group_lanes(codes, steps, nt, 1, ULB_TILES_LANES, x, lanes);
        else
            group_lanes(codes, steps, nt, 1, ULB_TILES_VNNI, x, lanes);
        return;
    case 2: group_lanes(codes, steps, nt, 2, ULB_TILES_VNNI, x, lanes); return;
    case 4: group_lanes(codes, steps, nt, 4, ULB_TILES_VNNI, x, lanes); return;
    default: group_lanes(codes, steps, nt, 8, ULB_TILES_VNNI, x, lanes); return;
    }
}

void ulb_panel_portable(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb,
                        float *facc, int32_t *dots) {
    const int64_t p = tile0 / ULB_PANEL_TILES, tk = ulb_tile_k(w->bits);
    for (int j = 0; j < nb; j++)
        for (int r = 0; r < ntiles * ULB_TILE; r++) facc[j * ULB_PANEL_ROWS + r] = 0.0f;
    for (int64_t g = 0; g < w->n_groups; g++) {
        const uint8_t *base = ulb_group_base(w, p, ntiles, g);
        const uint8_t *codes = base + ntiles * ULB_TILE_SCALE_BYTES;
        const int64_t ks0 = g * w->gsteps, ks1 = ks0 + ulb_group_steps(w, g);
        for (int j = 0; j < nb; j++) {
            int32_t lanes[ULB_PANEL_TILES][LANES];
            memset(lanes, 0, sizeof lanes);
            group_lanes_of_width(codes, ks1 - ks0, ntiles, w->bits, w->tiles, a->xq + (n0 + j) * a->ldq + ks0 * tk,
                                 lanes);
            ulb_lanes_out(w, base, lanes, ntiles, a->xsum[(n0 + j) * w->n_groups + g], g, j, facc, dots);
        }
    }
}
