/* The microkernels' software-prefetch distance, swept in one process and one
 * build: ulb_read_probe and a cold GEMV at each distance (ulb_prefetch_set
 * before each pass) over the same ~600 MiB rotation, taken in turn every
 * round. Prints each distance's % of the probe and its speed against the
 * distance this CPU gets by default (median of per-round ratios), so a new
 * CPU's best distance can be read off in one run.
 * Usage: prefetch_sweep [M K format threads rounds]; ULB_SWEEP_DISTS="0 8192"
 * picks the distances (default 0 4096 8192 16384 32768). */
#include <stdio.h>

#include "cold_blobs.h"

#define MAX_DISTS 16

typedef struct {
    uint8_t **blobs;
    int n, bits, ndist;
    int64_t nbytes, dist[MAX_DISTS + 1]; /* dist[0]: the default, timed like the others */
    const float *x;
    float *y;
    bench_shape a;
} sweep_job;

/* Candidate 0 reads the probe; candidate c > 0 runs the GEMV at dist[c - 1]. */
static int sweep_run(void *ctx, int c) {
    const sweep_job *j = ctx;
    if (c && ulb_prefetch_set(j->bits, j->dist[c - 1]) != ULB_OK) return 1;
    for (int i = 0; i < j->n; i++) {
        uint64_t checksum;
        if (c == 0) ulb_read_probe(j->blobs[i], j->nbytes, j->a.threads, &checksum);
        else if (ulb_linear(j->blobs[i], j->nbytes, 1, j->x, ULB_DT_F32, j->a.K, 1, NULL, ULB_DT_F32, j->y,
                            ULB_DT_F32, j->a.M, j->a.threads))
            return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    sweep_job job = {.a = bench_parse_shape(argc, argv, (bench_shape){14336, 4096, ULB_FMT_INT2_SYM, 1, 12})};
    if (!(job.blobs = bench_cold_blobs_of(&job.a, &job.nbytes, &job.n))) return 2;
    job.bits = ulb_format_get(job.a.format)->bits;
    job.dist[0] = ulb_prefetch_distance(job.bits);
    const char *env = getenv("ULB_SWEEP_DISTS");
    const char *s = env ? env : "0 4096 8192 16384 32768";
    char *end;
    for (job.ndist = 1; job.ndist <= MAX_DISTS; job.ndist++, s = end) {
        job.dist[job.ndist] = strtoll(s, &end, 10);
        if (end == s) break;
    }
    float *x = malloc(job.a.K * sizeof(float)), *y = malloc(job.a.M * sizeof(float));
    for (int64_t k = 0; k < job.a.K; k++) x[k] = (float)rand() / RAND_MAX - 0.5f;
    job.x = x, job.y = y;
    static bench_times t[MAX_DISTS + 2];
    if (bench_interleave(job.ndist + 1, job.a.rounds, NULL, sweep_run, &job, t)) {
        fprintf(stderr, "a distance was refused (multiples of 64 up to 1 MiB) or a GEMV failed\n");
        return 2;
    }
    ulb_prefetch_set(job.bits, job.dist[0]);
    printf("%s %ldx%ld, %d thread(s), %d rounds of %d blobs; default distance %ld: %.1f%% of the read probe\n",
           ulb_format_get(job.a.format)->name, (long)job.a.M, (long)job.a.K, job.a.threads, job.a.rounds, job.n,
           (long)job.dist[0], 100 * bench_ratio_median(t[0], t[1], job.a.rounds));
    for (int c = 2; c <= job.ndist; c++)
        printf("  prefetch %7ld: %5.1f%% of the read probe, %.3fx the default's speed\n", (long)job.dist[c - 1],
               100 * bench_ratio_median(t[0], t[c], job.a.rounds), bench_ratio_median(t[1], t[c], job.a.rounds));
    return 0;
}
