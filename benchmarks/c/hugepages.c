/* What 2 MiB pages are worth to a cold GEMV: the same matrix copied into two
 * ~600 MiB rotations, one madvised MADV_NOHUGEPAGE (4 KiB pages) and one
 * MADV_HUGEPAGE (transparent huge pages, as PyTorch's allocator gives large
 * tensors with THP_MEM_ALLOC_ENABLE=1), then ulb_read_probe and ulb_linear
 * over each, the four taken in turn every round. Prints GB/s of each and the
 * huge-page gain (median of per-round ratios). Needs THP in "madvise" or
 * "always" mode (/sys/kernel/mm/transparent_hugepage/enabled).
 * Usage: hugepages [M K format threads rounds] */
#include <stdio.h>

#include "cold_blobs.h"

enum { PROBE_4K, GEMV_4K, PROBE_HUGE, GEMV_HUGE, CANDIDATES };

typedef struct {
    uint8_t **rot[2]; /* [0] 4 KiB pages, [1] huge pages */
    int n[2];
    int64_t nbytes;
    const float *x;
    float *y;
    bench_shape a;
} hugepages_job;

/* Even candidates read the probe, odd ones run the GEMV; c / 2 picks the rotation. */
static int hugepages_run(void *ctx, int c) {
    const hugepages_job *j = ctx;
    return bench_pass(c % 2 ? BENCH_GEMV : BENCH_PROBE, j->rot[c / 2], j->n[c / 2], j->nbytes, &j->a, j->x, j->y);
}

int main(int argc, char **argv) {
    const bench_shape a = bench_parse_shape(argc, argv, (bench_shape){4096, 4096, ULB_FMT_INT2_SYM, 1, 10});
    const ulb_format_info *fi = ulb_format_get(a.format);
    const int64_t nbytes = ulb_packed_nbytes(a.format, a.M, a.K, 0);
    if (!fi || nbytes < 0) {
        fprintf(stderr, "bad format %d or shape %ldx%ld\n", a.format, (long)a.M, (long)a.K);
        return 2;
    }
    const bench_pack_fn pack = ulb_pack;
    uint8_t **rot[2];
    int n[2];
    const int advice[2] = {MADV_NOHUGEPAGE, MADV_HUGEPAGE};
    for (int h = 0; h < 2; h++)
        if (bench_cold_blobs(1, &pack, &nbytes, a.format, fi->max_code, a.M, a.K, 0, advice[h], &rot[h], &n[h]))
            return 2;
    float *x = malloc(a.K * sizeof(float)), *y = malloc(a.M * sizeof(float));
    for (int64_t k = 0; k < a.K; k++) x[k] = (float)rand() / RAND_MAX - 0.5f;
    hugepages_job job = {{rot[0], rot[1]}, {n[0], n[1]}, nbytes, x, y, a};
    static bench_times t[CANDIDATES];
    if (bench_interleave(CANDIDATES, a.rounds, NULL, hugepages_run, &job, t)) return 2;
    double gbps[CANDIDATES];
    for (int c = 0; c < CANDIDATES; c++) {
        double s[BENCH_MAX_ROUNDS];
        for (int r = 0; r < a.rounds; r++) s[r] = t[c][r + 1];
        gbps[c] = (double)n[c / 2] * nbytes / bench_median(s, a.rounds) / 1e9;
    }
    printf("%s %ldx%ld, %d thread(s), GB/s: 4 KiB pages probe %.1f GEMV %.1f; 2 MiB pages probe %.1f GEMV %.1f; "
           "huge-page speed-up: probe %.2fx, GEMV %.2fx\n",
           fi->name, (long)a.M, (long)a.K, a.threads, gbps[PROBE_4K], gbps[GEMV_4K], gbps[PROBE_HUGE],
           gbps[GEMV_HUGE], bench_ratio_median(t[PROBE_4K], t[PROBE_HUGE], a.rounds),
           bench_ratio_median(t[GEMV_4K], t[GEMV_HUGE], a.rounds));
    return 0;
}
