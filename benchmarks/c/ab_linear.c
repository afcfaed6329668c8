/* A/B of two builds of the kernel library inside one process: cold GEMV of
 * build A, of build B and ulb_read_probe over the same rotation of packed
 * blobs (~600 MiB), taken in turn every round, reported as the median of
 * per-round ratios. On the shared VMs of benchmarks/results the DRAM speed
 * differs between processes by more than most kernel changes are worth, so
 * two builds timed in separate processes cannot be compared. ab_builds.sh
 * builds it, with every symbol of build A prefixed A_ and of build B B_.
 * Each build packs its own copies of the same matrix, so two blob layouts
 * can be compared too; the probe reads A's.
 * Usage: ab_linear [M K format threads rounds]; AB_BF16=1 for bf16
 * activations and output (as the modules run under a bf16 model), AB_N=n
 * for n tokens a call (default 1; prefill sizes are compute-bound, so the
 * rotation matters little there), AB_FRESH_X=1 to rewrite x on the calling
 * thread before every GEMV call, as a model's previous layer does, so that
 * other threads fetch it from the caller's core (the copy is timed too, on
 * both sides). */
#include <stdio.h>

#include "cold_blobs.h"

#define ULB_AB_DECLARE(P)                                                                                 \
    ulb_status P##ulb_linear(const uint8_t *, int64_t, int64_t, const void *, ulb_dtype, int64_t, int64_t, \
                             const void *, ulb_dtype, void *, ulb_dtype, int64_t, int);                   \
    ulb_status P##ulb_read_probe(const uint8_t *, int64_t, int, uint64_t *);                             \
    ulb_status P##ulb_pack(int, int64_t, int64_t, int64_t, const uint8_t *, int64_t, const float *,       \
                           uint8_t *, int64_t);                                                           \
    int64_t P##ulb_packed_nbytes(int, int64_t, int64_t, int64_t);                                         \
    const ulb_format_info *P##ulb_format_get(int);
ULB_AB_DECLARE(A_)
ULB_AB_DECLARE(B_)

typedef struct {
    uint8_t **blobs, **blobs_b;
    int n;
    int64_t nbytes, nbytes_b;
    void *x;
    const void *x_src; /* with AB_FRESH_X: copied to x before each GEMV call */
    size_t x_bytes;
    void *ya, *yb;
    ulb_dtype dt;
    int64_t M, K, N;
    int threads;
} ab_job;

/* Candidate 0: the read probe over A's blobs; 1: build A's GEMV; 2: build B's. */
static int ab_run(void *ctx, int c) {
    const ab_job *j = ctx;
    for (int i = 0; i < j->n; i++) {
        uint64_t checksum;
        if (c && j->x_src) memcpy(j->x, j->x_src, j->x_bytes);
        ulb_status st = c == 0   ? A_ulb_read_probe(j->blobs[i], j->nbytes, j->threads, &checksum)
                        : c == 1 ? A_ulb_linear(j->blobs[i], j->nbytes, j->N, j->x, j->dt, j->K, 1, NULL, j->dt,
                                                j->ya, j->dt, j->M, j->threads)
                                 : B_ulb_linear(j->blobs_b[i], j->nbytes_b, j->N, j->x, j->dt, j->K, 1, NULL, j->dt,
                                                j->yb, j->dt, j->M, j->threads);
        if (st != ULB_OK) return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    const bench_shape a = bench_parse_shape(argc, argv, (bench_shape){2048, 2048, ULB_FMT_INT2_SYM, 1, 16});
    const int64_t M = a.M, K = a.K;
    const int fmt = a.format, threads = a.threads, rounds = a.rounds;
    const ulb_format_info *fi = A_ulb_format_get(fmt);
    const int64_t nbytes = A_ulb_packed_nbytes(fmt, M, K, 0), nbytes_b = B_ulb_packed_nbytes(fmt, M, K, 0);
    if (!fi || nbytes < 0 || nbytes_b < 0) {
        fprintf(stderr, "bad format %d or shape %ldx%ld\n", fmt, (long)M, (long)K);
        return 2;
    }
    int n;
    uint8_t **rot[2];
    const bench_pack_fn packs[2] = {A_ulb_pack, B_ulb_pack};
    const int64_t sizes[2] = {nbytes, nbytes_b};
    if (bench_cold_blobs(2, packs, sizes, fmt, fi->max_code, M, K, bench_page_advice(), rot, &n)) return 2;
    uint8_t **blobs = rot[0], **blobs_b = rot[1];
    const ulb_dtype dt = getenv("AB_BF16") ? ULB_DT_BF16 : ULB_DT_F32;
    const size_t esize = dt == ULB_DT_F32 ? 4 : 2;
    const int64_t N = getenv("AB_N") ? atoll(getenv("AB_N")) : 1;
    if (N < 1) {
        fprintf(stderr, "AB_N must be at least 1\n");
        return 2;
    }
    uint8_t *x = malloc(N * K * 4), *ya = malloc(N * M * 4), *yb = malloc(N * M * 4);
    for (int64_t k = 0; k < N * K; k++) {
        const float v = (float)rand() / RAND_MAX - 0.5f;
        memcpy(x + k * esize, (const uint8_t *)&v + 4 - esize, esize); /* bf16: the high half */
    }
    ulb_status sa = A_ulb_linear(blobs[0], nbytes, N, x, dt, K, 1, NULL, dt, ya, dt, M, threads);
    ulb_status sb = B_ulb_linear(blobs_b[0], nbytes_b, N, x, dt, K, 1, NULL, dt, yb, dt, M, threads);
    if (sa != ULB_OK || sb != ULB_OK) return 2;
    const int same = !memcmp(ya, yb, N * M * esize);
    uint8_t *x_src = NULL;
    if (getenv("AB_FRESH_X")) {
        x_src = malloc(N * K * esize);
        memcpy(x_src, x, N * K * esize);
    }
    ab_job job = {blobs, blobs_b, n, nbytes, nbytes_b, x, x_src, (size_t)(N * K * esize), ya, yb, dt, M, K, N,
                  threads};
    static bench_times t[3];
    if (bench_interleave(3, rounds, NULL, ab_run, &job, t)) return 2;
    /* The probe's speed tells which kind of minute this was: on the shared VM
     * of benchmarks/results the same stream reads 25-56 GB/s on two threads. */
    double probe_s[BENCH_MAX_ROUNDS];
    for (int r = 0; r < rounds; r++) probe_s[r] = t[0][r + 1];
    const double probe_gbps = (double)n * (double)nbytes / bench_median(probe_s, rounds) / 1e9;
    printf("%s %ldx%ld, N=%ld, %d thread(s), %s, %d rounds of %d blobs, probe %.1f GB/s: A %.1f%%, B %.1f%% of "
           "the read probe; B/A speed %.3f (median of per-round ratios)%s%s\n",
           fi->name, (long)M, (long)K, (long)N, threads, dt == ULB_DT_F32 ? "fp32" : "bf16", rounds, n, probe_gbps,
           100 * bench_ratio_median(t[0], t[1], rounds), 100 * bench_ratio_median(t[0], t[2], rounds),
           bench_ratio_median(t[1], t[2], rounds), x_src ? ", x rewritten before each call" : "",
           same ? "" : "; OUTPUTS DIFFER");
    return 0;
}
