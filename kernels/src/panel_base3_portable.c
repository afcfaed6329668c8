/* Portable microkernel of base-3 codes (ternary_base3; base3.h): plain C11
 * that compilers vectorise, for CPUs without one of x86/'s base-3 kernels.
 * Same contract as every ISA (internal.h): bit for bit the scalar reference.
 *
 * Each 64-byte tile is decoded once into its five digits with base3.h's
 * multiply (q = byte | 0x80; digit = q * 3 >> 8, then q = q * 3 mod 256),
 * 64 lanes at a time in 16-bit arithmetic, then every token's lanes take
 * digit j times the four activations of k-quad j (lane 4l + b: column 4j + b
 * of row l, layout.h), as the bit-field portable kernel does with fields,
 * eight lanes at a time against an 8-lane copy of the activations. */
#include <string.h>

#include "lanes_out.h"

#define LANES ULB_TILE_BYTES
#define PAT 8

/* codes[j][u]: digit j of byte u of the tile, with no branch (so that the
 * loops vectorise): d, or 2 - d = d + (2 - 2d) where the sign bit is set. */
static inline void decode_tile(const uint8_t *tile, uint8_t codes[ULB_BASE3_DIGITS][LANES]) {
    uint16_t q[LANES];
    uint8_t neg[LANES];
    for (int u = 0; u < LANES; u++) {
        q[u] = (uint16_t)(tile[u] | 0x80u);
        neg[u] = (uint8_t)(0u - (unsigned)(tile[u] >> 7));
    }
    for (int j = 0; j < ULB_BASE3_DIGITS; j++)
        for (int u = 0; u < LANES; u++) {
            const uint16_t t = (uint16_t)(q[u] * 3u);
            const uint8_t d = (uint8_t)(t >> 8);
            q[u] = t & 0xffu;
            codes[j][u] = (uint8_t)(d + (neg[u] & (uint8_t)(2u - 2u * d)));
        }
}

void ulb_panel_base3_portable(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0,
                              int nb, float *facc, int32_t *dots) {
    const int64_t p = tile0 / ULB_PANEL_TILES, tk = ulb_tile_k(w->bits);
    for (int n = 0; n < nb; n++)
        for (int r = 0; r < ntiles * ULB_TILE; r++) facc[n * ULB_PANEL_ROWS + r] = 0.0f;
    for (int64_t g = 0; g < w->n_groups; g++) {
        const uint8_t *base = ulb_group_base(w, p, ntiles, g);
        const uint8_t *tiles = base + ntiles * ULB_TILE_SCALE_BYTES;
        const int64_t ks0 = g * w->gsteps, steps = ulb_group_steps(w, g);
        int32_t lanes[ULB_NB_MAX][ULB_PANEL_TILES][LANES];
        memset(lanes, 0, sizeof lanes);
        for (int64_t i = 0; i < steps; i++) {
            /* digit j's four activations, twice: the pattern of 8 lanes (two rows) */
            int16_t xrep[ULB_NB_MAX][ULB_BASE3_DIGITS][PAT];
            for (int n = 0; n < nb; n++) {
                const int8_t *x = a->xq + (n0 + n) * a->ldq + (ks0 + i) * tk;
                for (int j = 0; j < ULB_BASE3_DIGITS; j++)
                    for (int u = 0; u < PAT; u++) xrep[n][j][u] = x[4 * j + u % 4];
            }
            for (int t = 0; t < ntiles; t++) {
                uint8_t codes[ULB_BASE3_DIGITS][LANES];
                decode_tile(tiles + (i * ntiles + t) * ULB_TILE_BYTES, codes);
                for (int n = 0; n < nb; n++)
                    for (int q0 = 0; q0 < LANES; q0 += PAT) {
                        int16_t sum[PAT];
                        for (int u = 0; u < PAT; u++) sum[u] = (int16_t)(codes[0][q0 + u] * xrep[n][0][u]);
                        for (int j = 1; j < ULB_BASE3_DIGITS; j++)
                            for (int u = 0; u < PAT; u++) sum[u] += (int16_t)(codes[j][q0 + u] * xrep[n][j][u]);
                        for (int u = 0; u < PAT; u++) lanes[n][t][q0 + u] += sum[u];
                    }
            }
        }
        for (int n = 0; n < nb; n++)
            ulb_lanes_out(w, base, lanes[n], ntiles, a->xsum[(n0 + n) * w->n_groups + g], g, n, facc, dots);
    }
}
