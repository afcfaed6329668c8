/* Streaming read of a buffer through the same pool and work split as the
 * GEMV: the memory roofline a GEMV is compared with, measured in the same run
 * and with the same access pattern (one contiguous stream per thread). It is
 * meant to be this CPU's best plain read:
 * - It prefetches as far ahead as the AVX-512 2-bit kernel on long groups
 *   (the 2-bit setting resolved for a group of unbounded length), whatever
 *   ISA is active: with 8 or 16 KiB ahead the plain loop reads 0.83-0.88x as
 *   fast on Zen 4 and 1.13-1.44x as fast on a Xeon, whose cores stream
 *   10-11 GB/s without it; so none on AMD, 8 KiB on Intel.
 * - Where AVX2 (or AVX-VNNI) is the CPU's best ISA it reads with 32-byte
 *   loads (ulb_probe_sum_avx2): on a Zen 3 (AVX2 only) the plain loop's 8-
 *   and 16-byte loads read 0.85-0.93x as fast (benchmarks/c/read_widths.c),
 *   and with 8 KiB ahead that plain loop gains only 1.01-1.12x, while the
 *   32-byte loop loses with it (0.84-0.91x, prefetch_sweep), so the prefetch
 *   rule above stands. Intel CPUs of that kind (32-byte loads with 8 KiB
 *   ahead) have not been measured. */
#include <stdatomic.h>

#include "internal.h"
#include "sched.h"

#define PROBE_UNIT (64 * 1024)

typedef struct {
    const uint8_t *p;
    int64_t nbytes, prefetch;
    ulb_probe_sum_fn sum_fn;
    _Atomic uint64_t sum;
} probe_job;

/* prefetch: a constant, so that the loop without it is the plain one. */
ALWAYS_INLINE uint64_t sum_words(const uint64_t *q, int64_t words, int64_t dist, const int prefetch) {
    const uint8_t *end = (const uint8_t *)(q + words);
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= words; i += 4) {
        if (prefetch && i % 8 == 0) ulb_prefetch_ahead((const uint8_t *)(q + i), dist, end); /* once a line */
        s0 += q[i];
        s1 += q[i + 1];
        s2 += q[i + 2];
        s3 += q[i + 3];
    }
    for (; i < words; i++) s0 += q[i];
    return s0 + s1 + s2 + s3;
}

static uint64_t sum_plain(const uint64_t *q, int64_t words, int64_t dist) {
    return dist ? sum_words(q, words, dist, 1) : sum_words(q, words, 0, 0);
}

/* Where AVX2 is the CPU's best ISA, ulb_probe_sum_avx2; on AVX-512 CPUs the
 * plain loop: on Zen 4 32-byte loads read 0.97-1.00x as fast as it and
 * 64-byte ones 0.85-0.88x (benchmarks/README.md). */
static ulb_probe_sum_fn probe_sum_for_cpu(void) {
#if defined(__x86_64__)
    const ulb_isa best = ulb_isa_best();
    if (best == ULB_ISA_AVX2 || best == ULB_ISA_AVXVNNI) return ulb_probe_sum_avx2;
#endif
    return sum_plain;
}

static void probe_range(void *ctx, int64_t u0, int64_t u1) {
    probe_job *job = ctx;
    const int64_t end = u1 * PROBE_UNIT < job->nbytes ? u1 * PROBE_UNIT : job->nbytes;
    const uint64_t *q = (const uint64_t *)(job->p + u0 * PROBE_UNIT);
    atomic_fetch_add(&job->sum, job->sum_fn(q, (end - u0 * PROBE_UNIT) / 8, job->prefetch));
}

ulb_status ulb_read_probe(const uint8_t *p, int64_t nbytes, int nthreads, uint64_t *checksum) {
    if (!p || nbytes < 0 || ((uintptr_t)p % 8)) return ULB_ERR_SHAPE;
    probe_job job = {p, nbytes, ulb_prefetch_resolve_for(ULB_ISA_AVX512, 2, nthreads, INT64_MAX),
                      probe_sum_for_cpu(), 0};
    ulb_status st = ulb_parallel(ULB_SCHED_PROBE, nthreads, (nbytes + PROBE_UNIT - 1) / PROBE_UNIT,
                                 probe_range, &job);
    if (checksum) *checksum = atomic_load(&job.sum);
    return st;
}
