/* Scalar reference of the output step every ISA's store_rows must match bit
 * for bit (see ulb_store_fn in internal.h). */
#include "../src/dtype.h"
#include "../src/internal.h"

void ulb_store_rows_ref(const ulb_out *o, const float *facc, int64_t n0, int nb, int64_t m0, int64_t rows) {
    for (int j = 0; j < nb; j++) {
        const float xs = o->xscale[n0 + j];
        const int64_t yrow = (n0 + j) * o->ldy + m0;
        for (int64_t r = 0; r < rows; r++) {
            float v = facc[j * ULB_PANEL_ROWS + r] * xs;
            if (o->bias) v = v + ulb_load_elem(o->bias, o->bias_dt, m0 + r);
            ulb_store_elem(o->y, o->y_dt, yrow + r, v);
        }
    }
}
