/* Cold GEMV through the C API (no Python, no torch): rotates over ~600 MiB of
 * distinct packed matrices so weights stream from DRAM, and compares packed
 * bytes per second with ulb_read_probe over the same blobs and threads,
 * alternating the two in rounds so that drifting DRAM bandwidth hits both
 * alike. For kernel tuning; benchmarks/gemv.py is the user-facing benchmark.
 * Usage: gemv_cold [M K format threads rounds] */
#include <stdio.h>

#include "cold_blobs.h"

int main(int argc, char **argv) {
    const bench_shape a = bench_parse_shape(argc, argv, (bench_shape){14336, 4096, ULB_FMT_INT2_SYM, 1, 8});
    const int64_t M = a.M, K = a.K;
    const int fmt = a.format, threads = a.threads, rounds = a.rounds;
    int64_t nbytes;
    int n;
    uint8_t **blobs = bench_cold_blobs_of(&a, &nbytes, &n);
    if (!blobs) return 2;
    const ulb_format_info *fi = ulb_format_get(fmt);
    float *x = malloc(K * sizeof(float)), *y = malloc(M * sizeof(float));
    for (int64_t k = 0; k < K; k++) x[k] = (float)rand() / RAND_MAX - 0.5f;
    double t_gemv = 0, t_read = 0;
    for (int r = 0; r <= rounds; r++) { /* round 0 warms up */
        const double t0 = bench_now_s();
        bench_pass(BENCH_PROBE, blobs, n, nbytes, &a, x, y);
        const double t1 = bench_now_s();
        if (bench_pass(BENCH_GEMV, blobs, n, nbytes, &a, x, y)) return 2;
        const double t2 = bench_now_s();
        if (r) t_read += t1 - t0, t_gemv += t2 - t1;
    }
    const double total = (double)rounds * n * nbytes;
    printf("%s M=%ld K=%ld threads=%d isa=%s: %.1f us/call, %.1f GB/s; read probe %.1f GB/s; %.0f%% of read\n",
           fi->name, (long)M, (long)K, threads, ulb_isa_name(ulb_isa_active()),
           t_gemv / rounds / n * 1e6, total / t_gemv / 1e9, total / t_read / 1e9, 100.0 * t_read / t_gemv);
    return 0;
}
