/* Shared by the cold-GEMV tools of benchmarks/c: a wall clock, a median, and
 * the rotation of packed matrices that keeps every call's weights in DRAM. */
#ifndef ULB_BENCH_COLD_BLOBS_H
#define ULB_BENCH_COLD_BLOBS_H

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ulb/ulb.h"

static inline double bench_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int bench_cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v. */
static inline double bench_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return v[n / 2];
}

/* The command line every cold tool takes: [M K format threads rounds]. */
typedef struct {
    int64_t M, K;
    int format, threads, rounds;
} bench_shape;

#define BENCH_MAX_ROUNDS 200

/* Fills what argv gives over the defaults in d; rounds kept in [1, BENCH_MAX_ROUNDS]. */
static inline bench_shape bench_parse_shape(int argc, char **argv, bench_shape d) {
    if (argc > 1) d.M = atoll(argv[1]);
    if (argc > 2) d.K = atoll(argv[2]);
    if (argc > 3) d.format = atoi(argv[3]);
    if (argc > 4) d.threads = atoi(argv[4]);
    if (argc > 5) d.rounds = atoi(argv[5]);
    if (d.rounds < 1) d.rounds = 1;
    if (d.rounds > BENCH_MAX_ROUNDS) d.rounds = BENCH_MAX_ROUNDS;
    return d;
}

typedef ulb_status (*bench_pack_fn)(int format, int64_t M, int64_t K, int64_t group_size, const uint8_t *codes,
                                    int64_t ldc, const float *scales, uint8_t *out, int64_t out_bytes);

/* One random M x K matrix of `format` (codes 0..max_code, per-channel
 * scales) packed by `pack`, then copied into separate allocations until they
 * hold ~600 MiB (at least 4 copies): by the time a copy comes round again the
 * others have pushed it out of every cache. Sets *count; NULL on failure. */
static inline uint8_t **bench_cold_blobs(bench_pack_fn pack, int format, int max_code, int64_t M, int64_t K,
                                         int64_t nbytes, int *count) {
    int n = (int)((600LL << 20) / nbytes);
    if (n < 4) n = 4;
    uint8_t *codes = malloc((size_t)(M * K));
    float *scales = malloc((size_t)M * sizeof(float));
    uint8_t **blobs = calloc((size_t)n, sizeof *blobs);
    if (!codes || !scales || !blobs) return NULL;
    for (int64_t i = 0; i < M * K; i++) codes[i] = (uint8_t)(rand() % (max_code + 1));
    for (int64_t i = 0; i < M; i++) scales[i] = 0.01f + 0.001f * (float)(i % 7);
    for (int i = 0; i < n; i++) {
        blobs[i] = aligned_alloc(64, (size_t)((nbytes + 63) / 64 * 64));
        if (!blobs[i]) return NULL;
        if (i > 0) memcpy(blobs[i], blobs[0], (size_t)nbytes);
        else if (pack(format, M, K, 0, codes, K, scales, blobs[0], nbytes) != ULB_OK) return NULL;
    }
    free(codes);
    free(scales);
    *count = n;
    return blobs;
}

#endif
