/* Shared by the cold-GEMV tools of benchmarks/c: a wall clock, a median, and
 * the rotation of packed matrices that keeps every call's weights in DRAM. */
#ifndef ULB_BENCH_COLD_BLOBS_H
#define ULB_BENCH_COLD_BLOBS_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
#include <string.h>
#include <time.h>

#include "ulb/ulb_testing.h"

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

/* Seconds of every round of one candidate; round 0 is the warm-up. */
typedef double bench_times[BENCH_MAX_ROUNDS + 1];

/* One timed pass of candidate c over its rotation; nonzero on failure. */
typedef int (*bench_run_fn)(void *ctx, int c);

/* Runs candidates c < ncand (those with enabled[c], or all when enabled is
 * NULL) in turn, rounds + 1 times, each round starting one candidate later
 * so that none is always first and drifting DRAM speed weighs on all alike
 * (each still follows the same neighbour within a round; shuffling the
 * order changed nothing measurable): t[c][r] = seconds of run(ctx, c) in
 * round r. Returns
 * the first failure of run, or 0. */
static inline int bench_interleave(int ncand, int rounds, const int *enabled, bench_run_fn run, void *ctx,
                                   bench_times *t) {
    for (int r = 0; r <= rounds; r++)
        for (int j = 0; j < ncand; j++) {
            const int c = (r + j) % ncand;
            if (enabled && !enabled[c]) continue;
            const double t0 = bench_now_s();
            const int rc = run(ctx, c);
            if (rc) return rc;
            t[c][r] = bench_now_s() - t0;
        }
    return 0;
}

/* Median over the timed rounds of num[r] / den[r]: two candidates timed
 * moments apart, so the ratio cancels the DRAM speed of that moment. */
static inline double bench_ratio_median(const bench_times num, const bench_times den, int rounds) {
    double v[BENCH_MAX_ROUNDS];
    for (int r = 0; r < rounds; r++) v[r] = num[r + 1] / den[r + 1];
    return bench_median(v, rounds);
}

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

/* Bytes of a cold set: 600 MiB, or 2.5 times the L3 where that is more
 * (the Xeon VMs of benchmarks/results/xeon_amx have an L3 where a 600 MiB
 * set is not safely out of it). */
static inline int64_t bench_cold_bytes(void) {
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return l3 > 0 && 5 * (int64_t)l3 / 2 > (600LL << 20) ? 5 * (int64_t)l3 / 2 : 600LL << 20;
}

/* One random M x K matrix of `format` (codes 0..max_code, scales per
 * group of group_size, per channel for 0), packed by each of nvar packers (two builds of the library may
 * lay blobs out differently), then copied until each variant holds
 * bench_cold_bytes (at least 4 copies): by the time a copy comes round again the others have
 * pushed it out of every cache. All copies share one allocation, the
 * variants' copies alternating and their pages faulted in turn, so that no
 * variant streams from better memory: on the VM of benchmarks/results, two
 * sets of identical blobs whose pages were faulted one set after the other
 * read 7-14% apart (the later set faster), in one arena as in separate
 * allocations. The arena starts on a 2 MiB boundary; `advice`, if not 0,
 * is given to madvise (MADV_HUGEPAGE, MADV_NOHUGEPAGE) before any page is
 * touched. Fills blobs[v][i] for i < *count; returns 0, or -1 on failure. */
static inline int bench_cold_blobs(int nvar, const bench_pack_fn *packs, const int64_t *nbytes, int format,
                                   int max_code, int64_t M, int64_t K, int64_t group_size, int advice,
                                   uint8_t ***blobs, int *count) {
    int64_t stride = 0;
    for (int v = 0; v < nvar; v++) stride += (nbytes[v] + 63) / 64 * 64;
    int n = (int)(bench_cold_bytes() * nvar / stride);
    if (n < 4) n = 4;
    const size_t huge = 2u << 20, arena_bytes = ((size_t)(stride * n) + huge - 1) / huge * huge;
    uint8_t *codes = malloc((size_t)(M * K)), *arena = aligned_alloc(huge, arena_bytes);
    const int64_t n_groups = group_size > 0 && group_size < K ? (K + group_size - 1) / group_size : 1;
    float *scales = malloc((size_t)(M * n_groups) * sizeof(float));
    if (!codes || !scales || !arena) return -1;
    if (advice && madvise(arena, arena_bytes, advice)) return -1;
    for (int64_t i = 0; i < M * K; i++) codes[i] = (uint8_t)(rand() % (max_code + 1));
    for (int64_t i = 0; i < M * n_groups; i++) scales[i] = 0.01f + 0.001f * (float)(i % 7);
    for (int v = 0, off = 0; v < nvar; v++) {
        if (!(blobs[v] = calloc((size_t)n, sizeof **blobs))) return -1;
        for (int i = 0; i < n; i++) blobs[v][i] = arena + i * stride + off;
        if (packs[v](format, M, K, group_size, codes, K, scales, blobs[v][0], nbytes[v]) != ULB_OK) return -1;
        off += (int)((nbytes[v] + 63) / 64 * 64);
    }
    /* Copy in address order, so that no variant gets the pages the kernel
     * hands out first. */
    for (int i = 1; i < n; i++)
        for (int v = 0; v < nvar; v++) memcpy(blobs[v][i], blobs[v][0], (size_t)nbytes[v]);
    free(codes);
    free(scales);
    *count = n;
    return 0;
}

enum { BENCH_PROBE, BENCH_GEMV };

/* One pass over blobs[0..n) of `what`: ulb_read_probe, or the one-token fp32
 * GEMV y = W x of shape a->M x a->K; both on a->threads threads. Nonzero if
 * a GEMV fails. */
static inline int bench_pass(int what, uint8_t *const *blobs, int n, int64_t nbytes, const bench_shape *a,
                             const float *x, float *y) {
    for (int i = 0; i < n; i++) {
        uint64_t checksum;
        if (what == BENCH_PROBE) ulb_read_probe(blobs[i], nbytes, a->threads, &checksum);
        else if (ulb_linear(blobs[i], nbytes, 1, x, ULB_DT_F32, a->K, 1, NULL, ULB_DT_F32, y, ULB_DT_F32, a->M,
                            a->threads))
            return 1;
    }
    return 0;
}

/* The madvise advice of the tools' rotations: MADV_HUGEPAGE with env
 * ULB_BENCH_HUGEPAGES=1 (where ulbtorch.hugepages puts a model's weights),
 * else none (4 KiB pages unless THP is "always"). hugepages.c sets its own. */
static inline int bench_page_advice(void) {
    const char *env = getenv("ULB_BENCH_HUGEPAGES");
    return env && atoi(env) ? MADV_HUGEPAGE : 0;
}

/* The rotation of a tool that links one build (gemv_cold, read_widths): the
 * format and shape of `a` checked, then its ulb_pack'ed copies. NULL, with a
 * message, on failure. */
static inline uint8_t **bench_cold_blobs_of(const bench_shape *a, int64_t *nbytes, int *count) {
    const ulb_format_info *fi = ulb_format_get(a->format);
    *nbytes = ulb_packed_nbytes(a->format, a->M, a->K, 0);
    if (!fi || *nbytes < 0) {
        fprintf(stderr, "bad format %d or shape %ldx%ld\n", a->format, (long)a->M, (long)a->K);
        return NULL;
    }
    uint8_t **blobs;
    const bench_pack_fn pack = ulb_pack;
    return bench_cold_blobs(1, &pack, nbytes, a->format, fi->max_code, a->M, a->K, 0, bench_page_advice(), &blobs,
                            count) ? NULL : blobs;
}

#endif
