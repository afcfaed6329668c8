/* The dynamic work split's table (kernels/src/sched.c) fed made-up
 * per-thread times: the EMA update of seed 002 to the last bit, its gain
 * scaled down on short calls, the floor that keeps a slow thread measured,
 * the static split, and one table per kernel family. tests/test_scheduler.py
 * runs the same table on real, timed threads; here nothing depends on the
 * machine. */
#include <math.h>
#include <stdio.h>

#include "../../kernels/src/sched.h"

static int fails, checks;

#define CHECK(cond, ...)                  \
    do {                                  \
        checks++;                         \
        if (!(cond)) {                    \
            fails++;                      \
            printf("FAIL line %d: ", __LINE__); \
            printf(__VA_ARGS__);          \
            printf("\n");                 \
        }                                 \
    } while (0)

static ulb_sched_stats stats(int bits) {
    ulb_sched_stats s;
    ulb_sched_stats_get(bits, ULB_ISA_AVX2, &s);
    return s;
}

/* One call of family `fam` on n threads over nwork units: split, then record
 * times of cost[i] microseconds per unit of each thread's share. */
static void call(int fam, int n, int64_t nwork, const double *cost) {
    int64_t b[ULB_MAX_THREADS], e[ULB_MAX_THREADS];
    double us[ULB_MAX_THREADS];
    ulb_sched_split(fam, n, nwork, b, e);
    for (int i = 0; i < n; i++) us[i] = (double)(e[i] - b[i]) * cost[i];
    ulb_sched_record(fam, n, b, e, us);
}

static void ema_toward_measured_speed(void) {
    const int fam = ulb_sched_family(2, ULB_ISA_AVX2);
    const double cost[2] = {1.0, 3.0}; /* thread 1 three times slower; calls >= 128 us: full gain */
    int64_t b[2], e[2];
    ulb_sched_reset();
    ulb_sched_split(fam, 2, 256, b, e);
    CHECK(b[0] == 0 && e[0] == 128 && b[1] == 128 && e[1] == 256, "fresh table splits equally: %ld %ld",
          (long)e[0], (long)e[1]);
    /* Speeds 1 and 1/3 unit/us: the measured share of thread 1 is 0.25, and
     * each call moves the ratio 0.3 of the way there. */
    double want = 0.5;
    for (int c = 1; c <= 12; c++) {
        call(fam, 2, 256, cost);
        want = 0.7 * want + 0.3 * 0.25;
        const ulb_sched_stats s = stats(2);
        CHECK(fabs(s.ratio[1] - want) < 1e-12 && fabs(s.ratio[0] + s.ratio[1] - 1.0) < 1e-12,
              "call %d: ratio %.15f, want %.15f", c, s.ratio[1], want);
        CHECK(s.calls == c && s.nthreads == 2, "call %d: %ld calls, %d threads", c, (long)s.calls, s.nthreads);
    }
    ulb_sched_split(fam, 2, 256, b, e);
    const int64_t e0 = (int64_t)((1.0 - want) * 256 + 0.5); /* 191 of 256 */
    CHECK(e[0] == e0 && b[1] == e0 && e[1] == 256, "split after 12 calls: %ld, want %ld", (long)e[0], (long)e0);
    /* Equal speeds again: back toward 0.5 at the same rate. */
    const double equal[2] = {1.0, 1.0};
    for (int c = 0; c < 12; c++) {
        call(fam, 2, 256, equal);
        want = 0.7 * want + 0.3 * 0.5;
    }
    CHECK(fabs(stats(2).ratio[1] - want) < 1e-9, "recovery: ratio %.12f, want %.12f", stats(2).ratio[1], want);
}

static void short_calls_move_less(void) {
    const int fam = ulb_sched_family(2, ULB_ISA_AVX2);
    int64_t b[2] = {0, 8}, e[2] = {8, 16};
    const double us[2] = {10.0, 30.0}; /* longest 30 us: gain 0.3 x 30 / 100 */
    ulb_sched_reset();
    ulb_sched_record(fam, 2, b, e, us);
    const double gain = 0.3 * 0.3;
    CHECK(fabs(stats(2).ratio[1] - ((1 - gain) * 0.5 + gain * 0.25)) < 1e-12, "short call: ratio %.15f",
          stats(2).ratio[1]);
}

static void slow_thread_keeps_a_unit(void) {
    const int fam = ulb_sched_family(2, ULB_ISA_AVX2);
    const double cost[2] = {1.0, 1e4};
    ulb_sched_reset();
    for (int c = 0; c < 60; c++) call(fam, 2, 4, cost);
    const ulb_sched_stats s = stats(2);
    /* Its measured share is 1e-4; the floor, 0.05 of an equal share, holds
     * it at 0.025 before the shares are renormalised to sum 1. */
    CHECK(s.ratio[1] > 0.024 && s.ratio[1] < 0.0251, "floored ratio %.6f", s.ratio[1]);
    CHECK(s.last_panels[1] == 1 && s.last_panels[0] == 3, "4 units: %ld / %ld", (long)s.last_panels[0],
          (long)s.last_panels[1]);
}

static void unmeasured_calls_leave_the_ratio(void) {
    const int fam = ulb_sched_family(2, ULB_ISA_AVX2);
    int64_t b[2] = {0, 4}, e[2] = {4, 4}; /* thread 1 had no work */
    const double us[2] = {500.0, 0.0};
    ulb_sched_reset();
    ulb_sched_record(fam, 2, b, e, us);
    const ulb_sched_stats s = stats(2);
    CHECK(s.calls == 1 && s.ratio[0] == 0.5 && s.ratio[1] == 0.5, "unmeasured: %ld calls, ratio %.3f",
          (long)s.calls, s.ratio[1]);
}

static void static_split_stays_equal(void) {
    const int fam = ulb_sched_family(2, ULB_ISA_AVX2);
    const double cost[2] = {1.0, 3.0};
    int64_t b[2], e[2];
    ulb_sched_reset();
    ulb_sched_set_static(1);
    for (int c = 0; c < 5; c++) call(fam, 2, 256, cost);
    ulb_sched_split(fam, 2, 256, b, e);
    ulb_sched_set_static(0);
    CHECK(e[0] == 128 && stats(2).ratio[1] == 0.5 && stats(2).calls == 5, "static: %ld, ratio %.3f",
          (long)e[0], stats(2).ratio[1]);
}

static void one_table_per_family(void) {
    const double cost[2] = {1.0, 3.0};
    ulb_sched_reset();
    for (int c = 0; c < 3; c++) call(ulb_sched_family(4, ULB_ISA_AVX2), 2, 256, cost);
    CHECK(stats(4).calls == 3 && stats(4).ratio[1] < 0.5, "4-bit table: %ld calls", (long)stats(4).calls);
    for (int bits = 1; bits <= 16; bits *= 2)
        if (bits != 4) CHECK(stats(bits).calls == 0, "%d-bit table moved", bits);
    /* A call on another thread count keeps what the family learned of each
     * thread (a model's short layers run on fewer threads than its long
     * ones): thread 1 stays the slow one, thread 2, new, starts as their
     * mean, and back on two threads the split is the one learned. */
    const double slow1[2] = {1.0, 3.0}, three[3] = {1.0, 3.0, 1.0};
    const double before = stats(4).ratio[1];
    int64_t b[3], e[3];
    ulb_sched_split(ulb_sched_family(4, ULB_ISA_AVX2), 3, 300, b, e);
    CHECK(e[0] - b[0] > e[1] - b[1] && e[2] - b[2] > e[1] - b[1] && e[2] - b[2] < e[0] - b[0],
          "3 threads split %ld %ld %ld", (long)(e[0] - b[0]), (long)(e[1] - b[1]), (long)(e[2] - b[2]));
    call(ulb_sched_family(4, ULB_ISA_AVX2), 3, 300, three);
    CHECK(stats(4).nthreads == 3 && stats(4).calls == 4 && stats(4).ratio[1] < stats(4).ratio[0],
          "3 threads: %d threads, %ld calls", stats(4).nthreads, (long)stats(4).calls);
    call(ulb_sched_family(4, ULB_ISA_AVX2), 2, 256, slow1);
    CHECK(stats(4).nthreads == 2 && stats(4).calls == 5 && stats(4).ratio[1] < before,
          "back on 2 threads: %ld calls, ratio %.3f (before %.3f)", (long)stats(4).calls, stats(4).ratio[1], before);
}

int main(void) {
    ema_toward_measured_speed();
    short_calls_move_less();
    slow_thread_keeps_a_unit();
    unmeasured_calls_leave_the_ratio();
    static_split_stays_equal();
    one_table_per_family();
    ulb_sched_reset();
    printf("%d passed, %d failed\n", checks - fails, fails);
    return fails != 0;
}
