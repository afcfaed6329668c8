/* Cold GEMV through the C API (no Python, no torch): rotates over ~600 MiB of
 * distinct packed matrices so weights stream from DRAM, and reports GB/s of
 * packed bytes per thread count. For kernel tuning; benchmarks/gemv.py is the
 * user-facing benchmark. Usage: gemv_cold [M K format threads] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ulb/ulb.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const int64_t M = argc > 1 ? atoll(argv[1]) : 14336, K = argc > 2 ? atoll(argv[2]) : 4096;
    const int fmt = argc > 3 ? atoi(argv[3]) : ULB_FMT_INT2_SYM;
    const int threads = argc > 4 ? atoi(argv[4]) : 1;
    const int64_t nbytes = ulb_packed_nbytes(fmt, M, K, 0);
    int n = (int)((600LL << 20) / nbytes);
    if (n < 4) n = 4;
    uint8_t *codes = malloc(M * K);
    float *sc = malloc(M * sizeof(float));
    for (int64_t i = 0; i < M * K; i++) codes[i] = (uint8_t)(rand() & (fmt == ULB_FMT_BINARY ? 1 : 3));
    for (int64_t i = 0; i < M; i++) sc[i] = 0.01f;
    uint8_t **blobs = malloc(n * sizeof *blobs);
    for (int i = 0; i < n; i++) {
        blobs[i] = aligned_alloc(64, (nbytes + 63) / 64 * 64);
        if (i == 0) ulb_pack(fmt, M, K, 0, codes, K, sc, blobs[0], nbytes);
        else memcpy(blobs[i], blobs[0], nbytes);
    }
    float *x = malloc(K * sizeof(float)), *y = malloc(M * sizeof(float));
    for (int64_t k = 0; k < K; k++) x[k] = (float)rand() / RAND_MAX - 0.5f;
    enum { REPS = 200 };
    double t[REPS];
    for (int r = 0; r < REPS + n; r++) {
        const double t0 = now_s();
        ulb_linear(blobs[r % n], nbytes, 1, x, ULB_DT_F32, K, 1, NULL, ULB_DT_F32, y, ULB_DT_F32, M, threads);
        if (r >= n) t[r - n] = now_s() - t0;
    }
    qsort(t, REPS, sizeof t[0], cmp);
    printf("%s M=%ld K=%ld threads=%d isa=%s: median %.1f us, %.1f GB/s (%d matrices of %.1f MiB)\n",
           ulb_format_get(fmt)->name, (long)M, (long)K, threads, ulb_isa_name(ulb_isa_active()),
           t[REPS / 2] * 1e6, nbytes / t[REPS / 2] / 1e9, n, nbytes / 1048576.0);
    return 0;
}
