/* The software-prefetch distance, swept in one process and one build: a cold
 * GEMV at each distance (ulb_prefetch_set for its code width before each
 * pass) and ulb_read_probe at each distance (the probe prefetches at the
 * 2-bit distance), all over the same ~600 MiB rotation, taken in turn every
 * round. Prints, per distance, the GEMV's % of the default probe and its
 * speed against the GEMV at the default setting ("auto" unless
 * ULB_PREFETCH_<bits>BIT says otherwise), and the probe's speed against the
 * default probe (medians of per-round ratios), so a new CPU's best distances
 * can be read off in one run.
 * Usage: prefetch_sweep [M K format threads rounds]; ULB_SWEEP_DISTS="0 8192"
 * picks the distances (default 0 4096 8192 16384 32768). */
#include <stdio.h>

#include "cold_blobs.h"

#define MAX_DISTS 16

typedef struct {
    uint8_t **blobs;
    int n, bits, ndist;
    int64_t nbytes, dist[MAX_DISTS + 1], probe_dist[MAX_DISTS + 1]; /* [0]: the settings at start */
    const float *x;
    float *y;
    bench_shape a;
} sweep_job;

/* Candidate 2i runs the GEMV at dist[i], 2i + 1 the probe at probe_dist[i]:
 * each sets the one distance it depends on before its pass. */
static int sweep_run(void *ctx, int c) {
    const sweep_job *j = ctx;
    const int probe = c % 2, i = c / 2;
    if (ulb_prefetch_set(probe ? 2 : j->bits, probe ? j->probe_dist[i] : j->dist[i]) != ULB_OK) return 1;
    return bench_pass(probe ? BENCH_PROBE : BENCH_GEMV, j->blobs, j->n, j->nbytes, &j->a, j->x, j->y);
}

int main(int argc, char **argv) {
    sweep_job job = {.a = bench_parse_shape(argc, argv, (bench_shape){14336, 4096, ULB_FMT_INT2_SYM, 1, 12})};
    if (!(job.blobs = bench_cold_blobs_of(&job.a, &job.nbytes, &job.n))) return 2;
    job.bits = ulb_format_get(job.a.format)->bits;
    ulb_prefetch_get(job.bits, &job.dist[0]);
    ulb_prefetch_get(2, &job.probe_dist[0]);
    const char *env = getenv("ULB_SWEEP_DISTS");
    const char *s = env ? env : "0 4096 8192 16384 32768";
    char *end;
    for (job.ndist = 1; job.ndist <= MAX_DISTS; job.ndist++, s = end) {
        job.dist[job.ndist] = job.probe_dist[job.ndist] = strtoll(s, &end, 10);
        if (end == s) break;
    }
    float *x = malloc(job.a.K * sizeof(float)), *y = malloc(job.a.M * sizeof(float));
    for (int64_t k = 0; k < job.a.K; k++) x[k] = (float)rand() / RAND_MAX - 0.5f;
    job.x = x, job.y = y;
    static bench_times t[2 * (MAX_DISTS + 1)];
    const int rc = bench_interleave(2 * job.ndist, job.a.rounds, NULL, sweep_run, &job, t);
    ulb_prefetch_set(job.bits, job.dist[0]);
    ulb_prefetch_set(2, job.probe_dist[0]);
    if (rc) {
        fprintf(stderr, "a distance was refused (multiples of 64 up to 1 MiB) or a GEMV failed\n");
        return 2;
    }
    const int r = job.a.rounds;
    printf("%s %ldx%ld, %d thread(s), %d rounds of %d blobs; defaults (-1 = auto): GEMV %ld, probe %ld; "
           "GEMV %.1f%% of the probe\n",
           ulb_format_get(job.a.format)->name, (long)job.a.M, (long)job.a.K, job.a.threads, r, job.n,
           (long)job.dist[0], (long)job.probe_dist[0], 100 * bench_ratio_median(t[1], t[0], r));
    for (int i = 1; i < job.ndist; i++)
        printf("  prefetch %7ld: GEMV %5.1f%% of the default probe, %.3fx the default GEMV's speed; "
               "probe %.3fx the default probe's speed\n",
               (long)job.dist[i], 100 * bench_ratio_median(t[1], t[2 * i], r), bench_ratio_median(t[0], t[2 * i], r),
               bench_ratio_median(t[1], t[2 * i + 1], r));
    return 0;
}
