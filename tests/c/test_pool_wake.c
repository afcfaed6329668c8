/* Jobs with the workers going to sleep between them (the test runs with
 * ULB_SPIN_US=0, so a worker sleeps on its futex once it finds no job), the
 * caller pausing 0 to 3.5 us between jobs so that a job is published at
 * every point of a worker's way to sleep: each job must wake the workers
 * it needs. A lost wake-up leaves the caller waiting
 * for good, which fails the test by timeout; each job also checks that
 * every unit of work ran once. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "../../kernels/src/internal.h"
#include "../../kernels/src/sched.h"

#define THREADS 2
#define JOBS 50000
#define MAX_UNITS 8

static int runs[MAX_UNITS];

static void mark_units(void *ctx, int64_t begin, int64_t end) {
    (void)ctx;
    for (int64_t u = begin; u < end; u++) runs[u]++;
}

static void pause_ns(long ns) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do clock_gettime(CLOCK_MONOTONIC, &t);
    while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < ns);
}

int main(void) {
    int fails = 0;
    for (int j = 0; j < JOBS; j++) {
        pause_ns(j % 8 * 500L);
        memset(runs, 0, sizeof runs);
        const int64_t units = 2 + j % (MAX_UNITS - 1);
        int wrong = ulb_parallel(ULB_SCHED_PROBE, THREADS, units, mark_units, NULL) != ULB_OK;
        for (int64_t u = 0; u < MAX_UNITS; u++) wrong |= runs[u] != (u < units);
        fails += wrong;
    }
    printf("%d passed, %d failed\n", JOBS - fails, fails);
    return fails != 0;
}
