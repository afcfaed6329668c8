/* The output step of the portable kernels (panel_portable.c,
 * panel_base3_portable.c), which sum a group into 64 lanes a tile: lane
 * 4l + b of tile t holds row 16t + l's products of column slot b. */
#ifndef ULB_LANES_OUT_H
#define ULB_LANES_OUT_H

#include <string.h>

#include "internal.h"

/* Group g of token j from its lanes, under the contract of internal.h:
 * dot = level_a * (the row's four lanes) + level_b * xsum, then
 * facc[j * 64 + r] += scale[r] * dot in fp32, and dots where asked; the
 * group's fp32 scales start at `scales`. */
static inline void ulb_lanes_out(const ulb_weight *w, const uint8_t *scales,
                                 const int32_t lanes[ULB_PANEL_TILES][ULB_TILE_BYTES], int ntiles, int32_t xsum,
                                 int64_t g, int j, float *facc, int32_t *dots) {
    for (int r = 0; r < ntiles * ULB_TILE; r++) {
        const int32_t *l4 = &lanes[r / ULB_TILE][4 * (r % ULB_TILE)];
        const int32_t dot = w->level_a * (l4[0] + l4[1] + l4[2] + l4[3]) + w->level_b * xsum;
        float s;
        memcpy(&s, scales + r * 4, sizeof s);
        facc[j * ULB_PANEL_ROWS + r] = facc[j * ULB_PANEL_ROWS + r] + s * (float)dot;
        if (dots) dots[(j * w->n_groups + g) * ULB_PANEL_ROWS + r] = dot;
    }
}

#endif
