/* The tables of the AVX2 1-bit lookup kernel, as x86/lut1_avx2.c defines
 * them, in plain C: the oracle of its vpshufb builder. */
#include "../src/internal.h"

void ulb_lut1_lanes_build_ref(const int8_t *xq, int64_t ksteps, uint8_t *lut) {
    for (int64_t ks = 0; ks < ksteps; ks++)
        for (int h = 0; h < 2; h++)
            for (int f = 0; f < 2; f++)
                for (int j = 0; j < 2; j++)
                    for (int n = 0; n < 16; n++) {
                        int l = 0, hi = 0;
                        for (int i = 0; i < 4; i++)
                            if (n >> i & 1) {
                                const int x = xq[32 * ks + 16 * f + 4 * i + 2 * h + j];
                                l += x & 15, hi += x >> 4;
                            }
                        uint8_t *tab = lut + ks * ULB_LUT1_STEP_BYTES + 32 * (4 * h + 2 * f) + 16 * j;
                        tab[n] = (uint8_t)l, tab[32 + n] = (uint8_t)(hi + 32);
                    }
}
