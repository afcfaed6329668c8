/* Streaming read of a buffer through the same pool and work split as the
 * GEMV: the memory roofline a GEMV is compared with, measured in the same run
 * and with the same access pattern (one contiguous stream per thread). It is
 * meant to be this CPU's best plain read:
 * - It prefetches as far ahead as the AVX-512 2-bit kernel on long groups
 *   (the 2-bit setting resolved for a group of unbounded length), whatever
 *   ISA is active: the plain loop loses with a prefetch on Zen 4 and gains
 *   on a Xeon; so none on AMD, 8 KiB on Intel.
 * - Where AVX2 (or AVX-VNNI) is the CPU's best ISA it reads with 32-byte
 *   loads (ulb_probe_sum_avx2): on a Zen 3 (AVX2 only) the plain loop's 8-
 *   and 16-byte loads read slower (benchmarks/c/read_widths.c), and the
 *   32-byte loop loses with a prefetch (prefetch_sweep), so the prefetch
 *   rule above stands. Intel CPUs of that kind (32-byte loads with 8 KiB
 *   ahead) have not been measured.
 * - One thread reading one sequential run may not draw all the bandwidth its
 *   core can (on the Zen 3 VM of benchmarks/results several interleaved
 *   runs read faster). ulb_read_probe_streams reads each thread's share,
 *   1 MiB at a time, as `streams` such runs (runs of a whole share lie far
 *   apart on big buffers and read slower there than one run).
 *   ulb_read_probe reads one run, the access pattern of the GEMV kernels;
 *   the benchmarks time both and take the faster as the machine's read
 *   bandwidth. */
#include <stdatomic.h>

#include "internal.h"
#include "sched.h"

#define PROBE_UNIT (64 * 1024)
#define PROBE_CHUNK (1 << 20) /* bytes read as one set of interleaved runs */

typedef struct {
    const uint8_t *p;
    int64_t nbytes, prefetch;
    int streams;
    ulb_probe_sum_fn sum_fn;
    _Atomic uint64_t sum;
} probe_job;

/* prefetch: a constant, so that the loop without it is the plain one. */
ALWAYS_INLINE uint64_t sum_words(const uint64_t *q, int64_t words, int streams, int64_t dist, const int prefetch) {
    const uint8_t *end = (const uint8_t *)(q + words);
    const int64_t run = ulb_probe_run_words(words, streams);
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int64_t i = 0; i < run; i += 8) /* a line of each run in turn */
        for (int r = 0; r < streams; r++) {
            const uint64_t *l = q + r * run + i;
            if (prefetch) ulb_prefetch_ahead((const uint8_t *)l, dist, end);
            s0 += l[0];
            s1 += l[1];
            s2 += l[2];
            s3 += l[3];
            s0 += l[4];
            s1 += l[5];
            s2 += l[6];
            s3 += l[7];
        }
    for (int64_t i = streams * run; i < words; i++) s0 += q[i];
    return s0 + s1 + s2 + s3;
}

static uint64_t sum_plain(const uint64_t *q, int64_t words, int streams, int64_t dist) {
    return dist ? sum_words(q, words, streams, dist, 1) : sum_words(q, words, streams, 0, 0);
}

/* Where AVX2 is the CPU's best ISA, ulb_probe_sum_avx2; on AVX-512 CPUs the
 * plain loop, which wider loads did not beat on Zen 4. */
static ulb_probe_sum_fn probe_sum_for_cpu(void) {
#if defined(__x86_64__)
    const ulb_isa best = ulb_isa_best();
    if (best == ULB_ISA_AVX2 || best == ULB_ISA_AVXVNNI) return ulb_probe_sum_avx2;
#endif
    return sum_plain;
}

static void probe_range(void *ctx, int64_t u0, int64_t u1) {
    probe_job *job = ctx;
    const int64_t start = u0 * PROBE_UNIT, end = u1 * PROBE_UNIT < job->nbytes ? u1 * PROBE_UNIT : job->nbytes;
    /* One run takes the whole share in one piece, prefetching up to its end. */
    const int64_t chunk = job->streams == 1 ? end - start : PROBE_CHUNK;
    uint64_t sum = 0;
    for (int64_t b = start; b < end; b += chunk) {
        const int64_t n = end - b < chunk ? end - b : chunk;
        sum += job->sum_fn((const uint64_t *)(job->p + b), n / 8, job->streams, job->prefetch);
    }
    atomic_fetch_add(&job->sum, sum);
}

ulb_status ulb_read_probe_streams(const uint8_t *p, int64_t nbytes, int nthreads, int streams,
                                  uint64_t *checksum) {
    if (!p || nbytes < 0 || ((uintptr_t)p % 8) || streams < 1 || streams > ULB_PROBE_MAX_STREAMS)
        return ULB_ERR_SHAPE;
    probe_job job = {p, nbytes, ulb_prefetch_resolve_for(ULB_ISA_AVX512, 2, nthreads, INT64_MAX), streams,
                      probe_sum_for_cpu(), 0};
    ulb_status st = ulb_parallel(ULB_SCHED_PROBE, nthreads, (nbytes + PROBE_UNIT - 1) / PROBE_UNIT,
                                 probe_range, &job);
    if (checksum) *checksum = atomic_load(&job.sum);
    return st;
}

ulb_status ulb_read_probe(const uint8_t *p, int64_t nbytes, int nthreads, uint64_t *checksum) {
    return ulb_read_probe_streams(p, nbytes, nthreads, 1, checksum);
}
