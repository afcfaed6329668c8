/* Scalar reference microkernel: the oracle every SIMD kernel must match
 * bit for bit (see the contract in internal.h). Reads codes one at a time
 * through the layout definition, so it is independent of any SIMD trick. */
#include "../src/internal.h"

void ulb_panel_ref(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a,
                   int64_t n0, int nb, float *facc, int32_t *dots) {
    const int64_t gs = w->gsteps * ulb_tile_k(w->bits);
    const ulb_layout L = ulb_weight_layout(w);
    for (int j = 0; j < nb; j++) {
        const int8_t *x = a->xq + (n0 + j) * a->ldq;
        const int32_t *xsum = a->xsum + (n0 + j) * w->n_groups;
        for (int r = 0; r < ntiles * ULB_TILE; r++) {
            const int64_t m = tile0 * ULB_TILE + r;
            float f = 0.0f;
            for (int64_t g = 0; g < w->n_groups; g++) {
                const int64_t k1 = (g + 1) * gs < w->K_pad ? (g + 1) * gs : w->K_pad;
                int32_t qx = 0;
                for (int64_t k = g * gs; k < k1; k++)
                    qx += (int32_t)ulb_code_get(w->panels, &L, m, k) * x[k];
                /* sum_k (a q_k + b) x_k = a sum q x + b sum x */
                const int32_t dot = w->level_a * qx + w->level_b * xsum[g];
                const float term = ulb_scale_get(w->panels, &L, m, g) * (float)dot;
                f = f + term;
                if (dots) dots[(j * w->n_groups + g) * ULB_PANEL_ROWS + r] = dot;
            }
            facc[j * ULB_PANEL_ROWS + r] = f;
        }
    }
}
