/* A/B of two builds of the kernel library inside one process: cold GEMV of
 * build A, of build B and ulb_read_probe over the same rotation of packed
 * blobs (~600 MiB), taken in turn every round, reported as the median of
 * per-round ratios. On the shared VMs of benchmarks/results the DRAM speed
 * differs between processes by more than most kernel changes are worth, so
 * two builds timed in separate processes cannot be compared. ab_builds.sh
 * builds it, with every symbol of build A prefixed A_ and of build B B_.
 * Each build packs its own copies of the same matrix, so two blob layouts
 * can be compared too; the probe reads A's.
 * Usage: ab_linear [M K format threads rounds]; format 16 times the
 * one-token bf16 GEMV (ulb_gemv_bf16) over plain bf16 weights instead, with
 * bf16 activations and output, and the probe reads those; AB_BF16=1 for bf16
 * activations and output (as the modules run under a bf16 model), AB_N=n
 * for n tokens a call (default 1; prefill sizes are compute-bound, so the
 * rotation matters little there), AB_FRESH_X=1 to rewrite x on the calling
 * thread before every GEMV call, as a model's previous layer does, so that
 * other threads fetch it from the caller's core (the copy is timed too, on
 * both sides), AB_GS=g to pack scales per group of g (default 0: per
 * channel). */
#include <stdio.h>

#include "cold_blobs.h"

#define ULB_AB_DECLARE(P)                                                                                 \
    ulb_status P##ulb_linear(const uint8_t *, int64_t, int64_t, const void *, ulb_dtype, int64_t, int64_t, \
                             const void *, ulb_dtype, void *, ulb_dtype, int64_t, int);                   \
    ulb_status P##ulb_read_probe(const uint8_t *, int64_t, int, uint64_t *);                             \
    ulb_status P##ulb_pack(int, int64_t, int64_t, int64_t, const uint8_t *, int64_t, const float *,       \
                           uint8_t *, int64_t);                                                           \
    int64_t P##ulb_packed_nbytes(int, int64_t, int64_t, int64_t);                                         \
    ulb_status P##ulb_gemv_bf16(const uint16_t *, int64_t, int64_t, int64_t, const uint16_t *, int64_t,    \
                                const void *, ulb_dtype, void *, ulb_dtype, int);                         \
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
    int threads, bf16_weights;
} ab_job;

#define AB_FMT_BF16 16

/* "Packs" codes as bf16 weights: (code - 127.5) / 256 in the high half of an
 * fp32, so the bf16 GEMV's rotation is made like the others. */
static ulb_status pack_bf16(int format, int64_t M, int64_t K, int64_t group_size, const uint8_t *codes, int64_t ldc,
                            const float *scales, uint8_t *out, int64_t out_bytes) {
    (void)format, (void)group_size, (void)scales;
    if (out_bytes < M * K * 2) return ULB_ERR_SHAPE;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) {
            const float v = ((float)codes[m * ldc + k] - 127.5f) / 256.0f;
            memcpy(out + (m * K + k) * 2, (const uint8_t *)&v + 2, 2);
        }
    return ULB_OK;
}

/* Build A's (b = 1) or B's (b = 2) GEMV on blob i, into ya or yb. */
static ulb_status ab_gemv(const ab_job *j, int b, int i) {
    if (j->bf16_weights)
        return (b == 1 ? A_ulb_gemv_bf16 : B_ulb_gemv_bf16)((const uint16_t *)(b == 1 ? j->blobs : j->blobs_b)[i], j->M,
                                                            j->K, j->K, j->x, 1, NULL, ULB_DT_F32,
                                                            b == 1 ? j->ya : j->yb, ULB_DT_BF16, j->threads);
    return b == 1 ? A_ulb_linear(j->blobs[i], j->nbytes, j->N, j->x, j->dt, j->K, 1, NULL, j->dt, j->ya, j->dt, j->M,
                                 j->threads)
                  : B_ulb_linear(j->blobs_b[i], j->nbytes_b, j->N, j->x, j->dt, j->K, 1, NULL, j->dt, j->yb, j->dt,
                                 j->M, j->threads);
}

/* Candidate 0: the read probe over A's blobs; 1: build A's GEMV; 2: build B's. */
static int ab_run(void *ctx, int c) {
    const ab_job *j = ctx;
    for (int i = 0; i < j->n; i++) {
        uint64_t checksum;
        if (c && j->x_src) memcpy(j->x, j->x_src, j->x_bytes);
        const ulb_status st = c == 0 ? A_ulb_read_probe(j->blobs[i], j->nbytes, j->threads, &checksum) : ab_gemv(j, c, i);
        if (st != ULB_OK) return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    const bench_shape a = bench_parse_shape(argc, argv, (bench_shape){2048, 2048, ULB_FMT_INT2_SYM, 1, 16});
    const int64_t M = a.M, K = a.K;
    const int fmt = a.format, threads = a.threads, rounds = a.rounds;
    const int bf16_weights = fmt == AB_FMT_BF16;
    static const ulb_format_info bf16_info = {.name = "bf16", .max_code = 255};
    const ulb_format_info *fi = bf16_weights ? &bf16_info : A_ulb_format_get(fmt);
    const int64_t gs = getenv("AB_GS") ? atoll(getenv("AB_GS")) : 0;
    const int64_t nbytes = bf16_weights ? M * K * 2 : A_ulb_packed_nbytes(fmt, M, K, gs);
    const int64_t nbytes_b = bf16_weights ? nbytes : B_ulb_packed_nbytes(fmt, M, K, gs);
    if (!fi || nbytes < 0 || nbytes_b < 0 || (bf16_weights && gs)) {
        fprintf(stderr, "bad format %d, shape %ldx%ld or group size %ld\n", fmt, (long)M, (long)K, (long)gs);
        return 2;
    }
    int n;
    uint8_t **rot[2];
    const bench_pack_fn packs[2] = {bf16_weights ? pack_bf16 : A_ulb_pack, bf16_weights ? pack_bf16 : B_ulb_pack};
    const int64_t sizes[2] = {nbytes, nbytes_b};
    if (bench_cold_blobs(2, packs, sizes, fmt, fi->max_code, M, K, gs, bench_page_advice(), rot, &n)) return 2;
    uint8_t **blobs = rot[0], **blobs_b = rot[1];
    const ulb_dtype dt = getenv("AB_BF16") || bf16_weights ? ULB_DT_BF16 : ULB_DT_F32;
    const size_t esize = dt == ULB_DT_F32 ? 4 : 2;
    const int64_t N = getenv("AB_N") ? atoll(getenv("AB_N")) : 1;
    if (N < 1 || (bf16_weights && N != 1)) {
        fprintf(stderr, "AB_N must be at least 1 (1 with bf16 weights)\n");
        return 2;
    }
    uint8_t *x = malloc(N * K * 4), *ya = aligned_alloc(64, (N * M * 4 + 63) / 64 * 64), *yb = aligned_alloc(64, (N * M * 4 + 63) / 64 * 64); /* 64-byte aligned, as PyTorch allocates */
    for (int64_t k = 0; k < N * K; k++) {
        const float v = (float)rand() / RAND_MAX - 0.5f;
        memcpy(x + k * esize, (const uint8_t *)&v + 4 - esize, esize); /* bf16: the high half */
    }
    ab_job job = {blobs, blobs_b, n, nbytes, nbytes_b, x, NULL, (size_t)(N * K * esize), ya, yb, dt, M, K, N,
                  threads, bf16_weights};
    if (ab_gemv(&job, 1, 0) != ULB_OK || ab_gemv(&job, 2, 0) != ULB_OK) return 2;
    const int same = !memcmp(ya, yb, N * M * esize);
    uint8_t *x_src = NULL;
    if (getenv("AB_FRESH_X")) {
        x_src = malloc(N * K * esize);
        memcpy(x_src, x, N * K * esize);
    }
    job.x_src = x_src;
    static bench_times t[3];
    if (bench_interleave(3, rounds, NULL, ab_run, &job, t)) return 2;
    /* The probe's speed tells which kind of minute this was: on the shared VM
     * of benchmarks/results the same stream reads 25-56 GB/s on two threads. */
    double probe_s[BENCH_MAX_ROUNDS];
    for (int r = 0; r < rounds; r++) probe_s[r] = t[0][r + 1];
    const double probe_gbps = (double)n * (double)nbytes / bench_median(probe_s, rounds) / 1e9;
    char groups[32] = "";
    if (gs > 0 && gs < K) snprintf(groups, sizeof groups, " g%ld", (long)gs);
    printf("%s%s %ldx%ld, N=%ld, %d thread(s), %s, %d rounds of %d blobs, probe %.1f GB/s: A %.1f%%, B %.1f%% of "
           "the read probe; B/A speed %.3f (median of per-round ratios)%s%s\n",
           fi->name, groups, (long)M, (long)K, (long)N, threads, dt == ULB_DT_F32 ? "fp32" : "bf16", rounds, n, probe_gbps,
           100 * bench_ratio_median(t[0], t[1], rounds), 100 * bench_ratio_median(t[0], t[2], rounds),
           bench_ratio_median(t[1], t[2], rounds), x_src ? ", x rewritten before each call" : "",
           same ? "" : "; OUTPUTS DIFFER");
    return 0;
}
