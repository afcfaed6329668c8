/* How fast one core streams from DRAM as a function of load width, next to
 * the 2-bit GEMV: plain read loops with 16-, 32- and 64-byte loads,
 * ulb_read_probe (what the Python benchmarks call "stream"), and ulb_linear
 * over the same rotation of packed blobs (~600 MiB, so every call is cold),
 * taken in turn every round. Prints GB/s and the median per-round ratio to
 * the probe. On the Zen 4 VM of benchmarks/results a 64-byte-load loop reads
 * ~10-14% slower than the 16-byte one unless an 8-byte load of each line
 * goes with it, and the AVX-512 GEMV, whose loads are 64 bytes, lands next
 * to the 64-byte loop.
 * Three more candidates run the AVX-512 2-bit one-token loop's instructions
 * (a 64-byte load, an 8-byte touch of the next line and a prefetch 8 KiB
 * ahead per tile, four masked vpdpbusd with broadcast operands, four tiles a
 * k-step; results discarded) on one thread: over the whole blob as one run,
 * and panel by panel as the kernel walks the blob (2-bit blobs only),
 * storing each panel's 64 fp32 results into an M-float buffer as the kernel
 * does or into a 1 KiB ring. On the Xeon of benchmarks/results (run X5) the
 * whole-blob loop and the ring read 93-100% of the probe, the loop storing
 * per panel into the M-float buffer 86-92%, next to the GEMV's 89-92%.
 * Two more run the 1-bit lookup kernel (ulb_lut1_group_avx512 at the GEMV's
 * prefetch distance, tables of a random token built once) panel by panel
 * over per-channel 1-bit blobs on one thread, each panel's sums into one
 * 64-entry buffer or into an M-entry buffer as the output step reads them
 * (run X6: 94-95% and 88-90% of the probe at K >= 4096, the GEMV 87-92%).
 * Usage: read_widths [M K format threads rounds]; every candidate runs on
 * `threads` threads, the plain loops over the probe's 64 KiB units and
 * work split. */
#include <immintrin.h>
#include <stdio.h>

#include "../../kernels/src/internal.h"
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

/* The kernel's loop over k-steps [0, ksteps) of 4 tiles from `codes`,
 * prefetching up to `end`, its 16 sums reduced into out[0..63] (or dropped). */
#define KERNEL_LOOP_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
static int8_t loop_x[65536] __attribute__((aligned(64)));
KERNEL_LOOP_TARGET static void kernel_loop(const uint8_t *codes, int64_t ksteps, const uint8_t *end, float *out) {
    __m512i acc[4][4];
    for (int t = 0; t < 4; t++)
        for (int j = 0; j < 4; j++) acc[t][j] = _mm512_setzero_si512();
    for (int64_t ks = 0; ks < ksteps; ks++) {
        const int8_t *xk = loop_x + (ks * 16) % (int64_t)sizeof loop_x;
        for (int t = 0; t < 4; t++) {
            const uint8_t *tile = codes + (ks * 4 + t) * 64;
            if (tile + 8192 < end) __builtin_prefetch(tile + 8192, 0, 2);
            const __m512i v = _mm512_loadu_si512(tile);
            int64_t unused;
            __asm__ volatile("movq %1, %0" : "=r"(unused) : "m"(*(const int64_t *)(tile + 64)));
            for (int j = 0; j < 4; j++) {
                const __m512i u = _mm512_and_si512(v, _mm512_set1_epi8((char)(3 << (2 * j))));
                __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc[t][j]) : "v"(u), "m"(*(const int32_t *)(xk + 4 * j)));
            }
        }
    }
    for (int t = 0; t < 4; t++) {
        const __m512i s = _mm512_add_epi32(_mm512_add_epi32(acc[t][0], acc[t][1]), _mm512_add_epi32(acc[t][2], acc[t][3]));
        if (out) _mm512_storeu_ps(out + 16 * t, _mm512_cvtepi32_ps(s));
        else sink += (uint64_t)_mm512_reduce_add_epi32(s);
    }
}

static float panel_out[1 << 20] __attribute__((aligned(64)));

/* ring: store panel p's results at (p % 4) * 64 instead of p * 64. */
static void kernel_loop_panels(const uint8_t *blob, int64_t nbytes, int ring) {
    ulb_weight w;
    if (ulb_weight_view(blob, nbytes, &w) != ULB_OK || w.bits != 2 || w.M_pad % ULB_PANEL_ROWS) abort();
    const int64_t np = ulb_weight_npanels(&w);
    const uint8_t *end = ulb_weight_panels_end(&w, np);
    for (int64_t p = 0; p < np; p++) {
        const uint8_t *group = ulb_group_base(&w, p, ULB_PANEL_TILES, 0);
        for (int t = 0; t < ULB_PANEL_TILES; t++) ulb_prefetch_ahead(group + t * 64, 8192, end);
        kernel_loop(group + ULB_PANEL_TILES * ULB_TILE_SCALE_BYTES, w.ksteps, end,
                    panel_out + (ring ? p % 4 : p) * ULB_PANEL_ROWS);
    }
}

/* The 1-bit lookup kernel over every panel of a per-channel 1-bit blob;
 * m_buffer: each panel's sums to its rows of panel_out, else all to one
 * 64-entry buffer. */
static void lut1_panels(const uint8_t *blob, int64_t nbytes, int m_buffer) {
    static uint8_t *tables;
    static int64_t tables_ksteps;
    ulb_weight w;
    if (ulb_weight_view(blob, nbytes, &w) != ULB_OK || w.bits != 1 || w.n_groups != 1 || w.M_pad % ULB_PANEL_ROWS)
        abort();
    if (tables_ksteps != w.ksteps) {
        int8_t *xq = ulb_aligned_alloc((size_t)w.K_pad);
        ulb_aligned_free(tables);
        tables = ulb_aligned_alloc((size_t)(w.ksteps * ULB_LUT1_STEP_BYTES));
        if (!xq || !tables) abort();
        for (int64_t k = 0; k < w.K_pad; k++) xq[k] = (int8_t)(rand() % 255 - 127);
        ulb_lut1_build_avx512(xq, w.ksteps, tables);
        ulb_aligned_free(xq);
        tables_ksteps = w.ksteps;
    }
    int32_t sums[ULB_PANEL_ROWS] __attribute__((aligned(64)));
    const int64_t dist = ulb_prefetch_resolve(w.bits, 1, ulb_weight_group_code_bytes(&w)); /* as the GEMV's */
    const int64_t np = ulb_weight_npanels(&w);
    const uint8_t *end = ulb_weight_panels_end(&w, np);
    for (int64_t p = 0; p < np; p++) {
        const uint8_t *group = ulb_group_base(&w, p, ULB_PANEL_TILES, 0);
        /* As the panel kernel, the scales too: the tile loop's prefetches
         * leave out the last lines of each panel. */
        for (int t = 0; t < ULB_PANEL_TILES; t++)
            ulb_prefetch_ahead(group + t * ULB_TILE_SCALE_BYTES, dist, end);
        const uint8_t *codes = group + ULB_PANEL_TILES * ULB_TILE_SCALE_BYTES;
        ulb_lut1_group_avx512(codes, 0, w.ksteps, ULB_PANEL_TILES, tables, dist, end,
                              m_buffer ? (int32_t *)panel_out + p * ULB_PANEL_ROWS : sums);
    }
}

enum { PROBE, R16, R32, R64, R64T, KLOOP, KPANELS, KRING, LUT1, LUT1M, GEMV, NCAND };

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
    if (c == KLOOP) {
        for (int i = 0; i < j->n; i++) kernel_loop(j->blobs[i], (j->nbytes - 64) / 256, j->blobs[i] + j->nbytes, NULL);
        return 0;
    }
    if (c == LUT1 || c == LUT1M) {
        for (int i = 0; i < j->n; i++) lut1_panels(j->blobs[i], j->nbytes, c == LUT1M);
        return 0;
    }
    if (c == KPANELS || c == KRING) {
        for (int i = 0; i < j->n; i++) kernel_loop_panels(j->blobs[i], j->nbytes, c == KRING);
        return 0;
    }
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
    const int have_vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
    const int loops = have_vnni && threads == 1 && fmt == ULB_FMT_INT2_SYM && M % ULB_PANEL_ROWS == 0 &&
                      M <= (int64_t)(sizeof panel_out / sizeof *panel_out);
    const int lut1 = have_vnni && __builtin_cpu_supports("avx512vbmi") && threads == 1 && fmt == ULB_FMT_BINARY &&
                     M % ULB_PANEL_ROWS == 0 && M <= (int64_t)(sizeof panel_out / sizeof *panel_out);
    for (int c = 0; c < NCAND; c++)
        runs[c] = c == R32 ? have256 : (c == R64 || c == R64T) ? have512 : (c >= KLOOP && c <= KRING) ? loops
                : (c == LUT1 || c == LUT1M) ? lut1 : 1;
    float *x = malloc(K * sizeof(float)), *y = malloc(M * sizeof(float));
    for (int64_t k = 0; k < K; k++) x[k] = (float)rand() / RAND_MAX - 0.5f;
    const char *names[NCAND] = {"ulb_read_probe", "16-byte loads", "32-byte loads", "64-byte loads", "64 + 8-byte", "kernel's loop", "... per panel", "... 1 KiB ring",
                                "1-bit lookups", "... M buffer", "GEMV"};
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
