/* Scalar reference of the one-token bf16 GEMV rows kernel (see
 * ulb_gemv_bf16_rows_fn in internal.h): the order of every fp32 operation is
 * the definition each ISA must match bit for bit. */
#include <math.h>

#include "../src/dtype.h"
#include "../src/internal.h"

/* The 32 columns of chunk c split into 16 even and 16 odd lanes (columns
 * 32c + 2i and 32c + 2i + 1), each fused-multiply-added into accumulator set
 * c mod 4; columns past K read as zero. */
void ulb_gemv_bf16_rows_ref(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                            float *out) {
    const int64_t chunks = (K + 31) / 32;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *wr = w + r * ldw;
        float acc[ULB_BF16_SETS][2][16] = {{{0}}};
        for (int64_t c = 0; c < chunks; c++)
            for (int half = 0; half < 2; half++)
                for (int i = 0; i < 16; i++) {
                    const int64_t k = 32 * c + 2 * i + half;
                    const float wk = k < K ? ulb_bf16_to_f32(wr[k]) : 0.0f;
                    const float xk = k < K ? ulb_bf16_to_f32(x[k]) : 0.0f;
                    float *a = &acc[c % ULB_BF16_SETS][half][i];
                    *a = fmaf(wk, xk, *a);
                }
        float v[16];
        for (int i = 0; i < 16; i++) {
            float lane[2];
            for (int half = 0; half < 2; half++)
                lane[half] = (acc[0][half][i] + acc[1][half][i]) + (acc[2][half][i] + acc[3][half][i]);
            v[i] = lane[0] + lane[1];
        }
        for (int width = 8; width >= 1; width /= 2)
            for (int i = 0; i < width; i++) v[i] = v[i] + v[i + width];
        out[r] = v[0];
    }
}
