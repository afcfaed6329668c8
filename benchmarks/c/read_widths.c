/* How fast one core streams from DRAM as a function of load width, next to
 * the 2-bit GEMV: plain read loops with 16-, 32- and 64-byte loads,
 * ulb_read_probe (what the Python benchmarks call "stream"), and ulb_linear
 * over the same rotation of packed blobs (~600 MiB, so every call is cold),
 * taken in turn every round. Prints GB/s and the median per-round ratio to
 * the probe. On the Zen 4 VM of benchmarks/results a 64-byte-load loop reads
 * ~10-14% slower than the 16-byte one unless an 8-byte load of each line
 * goes with it, and the AVX-512 GEMV, whose loads are 64 bytes, lands next
 * to the 64-byte loop.
 * Usage: read_widths [M K format threads rounds]; every candidate runs on
 * `threads` threads, the plain loops over the probe's 64 KiB units and
 * work split. */
#include <immintrin.h>
#include <stdio.h>

#include "../../kernels/src/sched.h"
#include "cold_blobs.h"

static volatile uint64_t sink;

static void read16(const uint8_t *p, int64_t n) {
    __m128i a = _mm_setzero_si128(), b = a;
    for (int64_t i = 0; i + 32 <= n; i += 32) {
        a = _mm_add_epi64(a, _mm_load_si128((const __m128i *)(p + i)));
        b = _mm_add_epi64(b, _mm_load_si128((const __m128i *)(p + i + 16)));
    }
    sink = (uint64_t)_mm_cvtsi128_si64(_mm_add_epi64(a, b));
}

__attribute__((target("avx2"))) static void read32(const uint8_t *p, int64_t n) {
    __m256i a = _mm256_setzero_si256(), b = a;
    for (int64_t i = 0; i + 64 <= n; i += 64) {
        a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i *)(p + i)));
        b = _mm256_add_epi64(b, _mm256_load_si256((const __m256i *)(p + i + 32)));
    }
    sink = (uint64_t)_mm256_extract_epi64(_mm256_add_epi64(a, b), 0);
}

__attribute__((target("avx512f"))) static void read64(const uint8_t *p, int64_t n) {
    __m512i a = _mm512_setzero_si512(), b = a;
    for (int64_t i = 0; i + 128 <= n; i += 128) {
        a = _mm512_add_epi64(a, _mm512_load_si512(p + i));
        b = _mm512_add_epi64(b, _mm512_load_si512(p + i + 64));
    }
    sink = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a, b));
}

/* 64-byte loads plus an 8-byte load of each line (see touch_line in
 * kernels/x86/panel_avx512.c). */
__attribute__((target("avx512f"))) static void read64_touch(const uint8_t *p, int64_t n) {
    __m512i a = _mm512_setzero_si512();
    for (int64_t i = 0; i + 64 <= n; i += 64) {
        int64_t unused;
        a = _mm512_add_epi64(a, _mm512_load_si512(p + i));
        __asm__ volatile("movq %1, %0" : "=r"(unused) : "m"(*(const int64_t *)(p + i)));
    }
    sink = (uint64_t)_mm512_reduce_add_epi64(a);
}

enum { PROBE, R16, R32, R64, R64T, GEMV, NCAND };

#define READ_UNIT (64 * 1024) /* as kernels/src/probe.c */

typedef struct {
    const uint8_t *p;
    int64_t nbytes;
    int loop;
} read_job;

static void read_range(void *ctx, int64_t u0, int64_t u1) {
    const read_job *job = ctx;
    const int64_t b0 = u0 * READ_UNIT, b1 = u1 * READ_UNIT < job->nbytes ? u1 * READ_UNIT : job->nbytes;
    void (*const loops[])(const uint8_t *, int64_t) = {[R16] = read16, [R32] = read32, [R64] = read64,
                                                       [R64T] = read64_touch};
    loops[job->loop](job->p + b0, b1 - b0);
}

static void read_parallel(int loop, const uint8_t *p, int64_t nbytes, int threads) {
    read_job job = {p, nbytes, loop};
    ulb_parallel(ULB_SCHED_PROBE, threads, (nbytes + READ_UNIT - 1) / READ_UNIT, read_range, &job);
}

typedef struct {
    uint8_t **blobs;
    int n;
    int64_t nbytes;
    const float *x;
    float *y;
    bench_shape a;
} widths_job;

static int widths_run(void *ctx, int c) {
    const widths_job *j = ctx;
    if (c == PROBE || c == GEMV)
        return bench_pass(c == GEMV ? BENCH_GEMV : BENCH_PROBE, j->blobs, j->n, j->nbytes, &j->a, j->x, j->y);
    for (int i = 0; i < j->n; i++) read_parallel(c, j->blobs[i], j->nbytes, j->a.threads);
    return 0;
}

int main(int argc, char **argv) {
    const bench_shape a = bench_parse_shape(argc, argv, (bench_shape){4096, 4096, ULB_FMT_INT2_SYM, 1, 15});
    const int64_t M = a.M, K = a.K;
    const int fmt = a.format, threads = a.threads, rounds = a.rounds;
    int64_t nbytes;
    int n;
    uint8_t **blobs = bench_cold_blobs_of(&a, &nbytes, &n);
    if (!blobs) return 2;
    const ulb_format_info *fi = ulb_format_get(fmt);
    const int have512 = __builtin_cpu_supports("avx512f"), have256 = __builtin_cpu_supports("avx2");
    int runs[NCAND];
    for (int c = 0; c < NCAND; c++) runs[c] = c == R32 ? have256 : (c == R64 || c == R64T) ? have512 : 1;
    float *x = malloc(K * sizeof(float)), *y = malloc(M * sizeof(float));
    for (int64_t k = 0; k < K; k++) x[k] = (float)rand() / RAND_MAX - 0.5f;
    const char *names[NCAND] = {"ulb_read_probe", "16-byte loads", "32-byte loads", "64-byte loads", "64 + 8-byte", "GEMV"};
    widths_job job = {blobs, n, nbytes, x, y, a};
    static bench_times t[NCAND];
    if (bench_interleave(NCAND, rounds, runs, widths_run, &job, t)) return 2;
    printf("%s M=%ld K=%ld, %d thread(s), isa=%s, %d rounds of %d blobs of %.2f MiB\n", fi->name,
           (long)M, (long)K, threads, ulb_isa_name(ulb_isa_active()), rounds, n, nbytes / 1048576.0);
    for (int c = 0; c < NCAND; c++) {
        if (!runs[c]) continue;
        double total = 0;
        for (int r = 1; r <= rounds; r++) total += t[c][r];
        printf("  %-15s %6.1f GB/s  %5.1f%% of the probe (median of per-round ratios)\n", names[c],
               (double)rounds * n * nbytes / total / 1e9, 100 * bench_ratio_median(t[PROBE], t[c], rounds));
    }
    return 0;
}
