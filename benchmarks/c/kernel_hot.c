/* In-cache throughput of each microkernel (the gamma of seed 000's roofline):
 * codes per ns and bytes per ns on one core, min over repeats.
 * Build: see benchmarks/README.md. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../kernels/src/internal.h"

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv) {
    const int64_t M = 256, K = argc > 1 ? atoll(argv[1]) : 4096;
    /* 1-bit codes in both tile orders (ulb_tiles). */
    const int fmts[] = {ULB_FMT_INT2_SYM, ULB_FMT_BINARY, ULB_FMT_BINARY, ULB_FMT_INT4};
    const int orders[] = {ULB_TILES_VNNI, ULB_TILES_VNNI, ULB_TILES_LANES, ULB_TILES_VNNI};
    for (int f = 0; f < 4; f++) {
        const int fmt = fmts[f], bits = ulb_format_get(fmt)->bits;
        const int64_t nbytes = ulb_packed_nbytes(fmt, M, K, 0);
        uint8_t *codes = calloc(M * K, 1), *blob = ulb_aligned_alloc(nbytes);
        float *sc = calloc(M, 4);
        for (int64_t i = 0; i < M * K; i++) codes[i] = (uint8_t)(rand() % (1 << bits));
        for (int64_t i = 0; i < M; i++) sc[i] = 1.0f;
        ulb_pack_tiles(fmt, orders[f], M, K, 0, codes, K, sc, blob, nbytes);
        ulb_weight w;
        ulb_weight_view(blob, nbytes, &w);
        int8_t *xq = ulb_aligned_alloc(ULB_NB_MAX * w.K_pad);
        int32_t xsum[ULB_NB_MAX] = {0};
        for (int64_t i = 0; i < ULB_NB_MAX * w.K_pad; i++) xq[i] = (int8_t)(rand() % 255 - 127);
        uint8_t *lut1 = ulb_aligned_alloc(ULB_NB_MAX * w.ksteps * ULB_LUT1_STEP_BYTES);
        float facc[ULB_NB_MAX * ULB_PANEL_ROWS];
        for (int isa = ULB_ISA_AVX2; isa < ULB_ISA_COUNT; isa++) {
            if (!ulb_isa_supported(isa)) continue;
            ulb_panel_fn fn = ulb_panel_for_isa(isa);
            /* 1-bit one-token calls also with the lookup tables, whatever ulb_lut1_serves says. */
            const ulb_lut1_build_fn build = ulb_lut1_builder_for(&w, isa);
            for (int n = 0; build && n < ULB_NB_MAX; n++)
                build(xq + n * w.K_pad, w.ksteps, lut1 + n * w.ksteps * ULB_LUT1_STEP_BYTES);
            const int luts = build ? 2 : 1;
            /* Calls of N = 1, 4 and 512 tokens (the kernel picks its loop by
             * N), each kernel call taking nb = min(N, ULB_NB_MAX) of them. */
            const int64_t Ns[] = {1, ULB_NB_MAX, 512};
            for (int lut = 0; lut < luts; lut++)
                for (int c = 0; c < 3; c++) {
                    const int64_t N = Ns[c];
                    const int nb = N < ULB_NB_MAX ? (int)N : ULB_NB_MAX;
                    /* Several tokens take tables over LANES tiles only, and at most ULB_NB_MAX. */
                    if (lut && (N > ULB_NB_MAX || (nb > 1 && orders[f] == ULB_TILES_VNNI))) continue;
                    const ulb_acts a = ulb_acts_of(&w, N, xq, xsum, lut ? lut1 : NULL, 1);
                    double best = 1e30;
                    for (int rep = 0; rep < 200; rep++) {
                        const double t0 = now_ns();
                        for (int64_t p = 0; p < M / ULB_PANEL_ROWS; p++) fn(&w, p * 4, 4, &a, 0, nb, facc, NULL);
                        const double dt = now_ns() - t0;
                        if (dt < best) best = dt;
                    }
                    printf("%-8s %-5s %-8s%-5s N=%-3d  %6.1f Gcode/s  %6.1f GB/s of codes (x%d tokens)\n",
                           ulb_format_get(fmt)->name, orders[f] ? "lanes" : "vnni", ulb_isa_name(isa),
                           lut ? "+lut1" : "", (int)N, M * K * nb / best, (nbytes - 64) / best, nb);
                }
        }
    }
    return 0;
}
