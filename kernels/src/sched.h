/* Dynamic work split for cores of unequal speed (seed 002): a table of each
 * thread's share of the work per kernel family, updated after every call
 * from the measured per-thread times with an EMA filter. */
#ifndef ULB_SCHED_H
#define ULB_SCHED_H

#include "internal.h"

#define ULB_SCHED_PROBE 6    /* ulb_read_probe */
#define ULB_SCHED_BF16 7     /* + ISA: ulb_gemv_bf16 (bits 16 in ulb_sched_family) */
#define ULB_SCHED_INT8 10    /* + ISA: 8-bit codes */
#define ULB_SCHED_INT4 13    /* + ISA: 4-bit codes */
#define ULB_SCHED_BASE3 16   /* + ISA: base-3 codes */
#define ULB_SCHED_FAMILIES 19 /* bits {1,2} x ISA {scalar, avx2, avx512}, probe, bf16 x ISA, 8-bit x ISA,
                               * 4-bit x ISA, base 3 x ISA */

void ulb_sched_split(int family, int nthreads, int64_t nwork, int64_t *begin, int64_t *end);
void ulb_sched_record(int family, int nthreads, const int64_t *begin, const int64_t *end,
                      const double *us);
double ulb_sched_slowdown(int tid);
void ulb_sched_before_fork(void);
void ulb_sched_after_fork(void); /* in the parent and in the child */

#endif
