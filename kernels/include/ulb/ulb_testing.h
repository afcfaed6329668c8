/* ulbtorch kernels: what only tests and benchmarks call, kept out of the
 * public API (ulb.h). The integer core alone, the memory read probe, and the
 * scheduler's knobs. The symbols are exported like the rest: Python's tests
 * and benchmarks reach them through ctypes. */
#ifndef ULB_ULB_TESTING_H
#define ULB_ULB_TESTING_H

#include "ulb.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Integer core alone: dots[n, m, g] = sum_{k in g} level[m,k] * xq[n,k]
 * from already-quantised activations xq (N x K_pad) and their per-group sums
 * xsum (N x n_groups), as ulb_quantize_act gives them: ULB_ERR_SHAPE if xq
 * is not zero past K or xsum is not its group sums. */
ulb_status ulb_int_dots(const uint8_t *blob, int64_t nbytes, int64_t N,
                        const int8_t *xq, const int32_t *xsum, int32_t *dots);

/* Reads nbytes (8-byte aligned) with nthreads through the GEMV's thread pool
 * and work split: the memory roofline for benchmarks, measured in the same
 * run as the kernels. It prefetches at the 2-bit setting resolved for long
 * groups (ulb_prefetch_resolve). */
ulb_status ulb_read_probe(const uint8_t *p, int64_t nbytes, int nthreads, uint64_t *checksum);
/* The same bytes and checksum, each thread's share read 1 MiB at a time as
 * `streams` (1 to ULB_PROBE_MAX_STREAMS) equal runs, a 64-byte line of each
 * in turn: some cores draw more bandwidth from several runs than from one
 * (probe.c). ULB_ERR_SHAPE for another count. */
#define ULB_PROBE_MAX_STREAMS 8
ulb_status ulb_read_probe_streams(const uint8_t *p, int64_t nbytes, int nthreads, int streams,
                                  uint64_t *checksum);

/* XXH64 of n bytes (the hash of the blob checksum, src/checksum.c), for its
 * published test vectors. */
uint64_t ulb_xxh64(const void *data, int64_t n, uint64_t seed);

/* 0: dynamic split (seed 002, EMA gain 0.3); 1: static equal split. */
void ulb_sched_set_static(int on);
/* Thread `tid` burns extra time proportional to its work (factor 1.0 =
 * none, 2.0 = twice as slow, at most ULB_SLOWDOWN_MAX: a larger one would
 * stall the next call for minutes). */
#define ULB_SLOWDOWN_MAX 1000.0
ulb_status ulb_sched_set_slowdown(int tid, double factor);

#ifdef __cplusplus
}
#endif
#endif
