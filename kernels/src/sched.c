#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "sched.h"

#define EMA_GAIN 0.3
/* Calls shorter than this update the table with a proportionally smaller
 * gain: their per-thread times are mostly noise (wake-up, DRAM hiccups), and
 * the full gain swung short calls' splits far from even from call to call.
 * The table is per kernel family, so the long calls of the same model keep
 * it current. */
#define FULL_GAIN_US 100.0
/* A thread keeps at least this fraction of an equal share, so it stays
 * measured and can win work back when it speeds up again. */
#define MIN_SHARE 0.05

/* weight[i]: thread i's speed on this family, up to a common factor; a
 * call on n threads splits by the first n. The table outlives changes of the
 * thread count (a model's short layers run on fewer threads than its long
 * ones, ulb_parallel gives each thread a panel at least), so thread i keeps
 * what was learned of it; 0 = never measured. */
typedef struct {
    int nthreads; /* of the last call */
    int64_t calls;
    double weight[ULB_MAX_THREADS];
    double last_us[ULB_MAX_THREADS];
    int64_t last_work[ULB_MAX_THREADS];
} table;

static table tables[ULB_SCHED_FAMILIES];
/* Test knobs, set from Python while workers may read them. */
static _Atomic double slowdown[ULB_MAX_THREADS];
static _Atomic int static_split;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* First family of a code width (one per ISA follows), or -1 for a width
 * with no kernels; bits 16 is the bf16 GEMV. */
static int family_base(int bits) {
    switch (bits) {
    case 1: return 0;
    case 2: return 3;
    case 4: return ULB_SCHED_INT4;
    case 8: return ULB_SCHED_INT8;
    case ULB_BASE3_BITS: return ULB_SCHED_BASE3;
    case 16: return ULB_SCHED_BF16;
    default: return -1;
    }
}

int ulb_sched_family(int bits, ulb_isa isa) {
    const int base = family_base(bits);
    /* The AVX-VNNI kernels are the AVX2 ones with another multiply: one
     * table. The portable kernels share the scalar ones' (a CPU runs one of
     * the two, the other only in tests), and AMX (the AVX-512 kernels but for
     * prefill) AVX-512's. An ARM CPU runs none of the x86 kernels: NEON takes
     * AVX2's slot, DOTPROD and I8MM (its kernels but for several tokens)
     * AVX-512's. */
    const ulb_isa slot = isa == ULB_ISA_AVXVNNI || isa == ULB_ISA_NEON  ? ULB_ISA_AVX2
                         : isa == ULB_ISA_PORTABLE                      ? ULB_ISA_SCALAR
                         : isa == ULB_ISA_AMX || isa == ULB_ISA_DOTPROD || isa == ULB_ISA_I8MM ? ULB_ISA_AVX512
                                                                        : isa;
    return (base < 0 ? ULB_SCHED_BF16 : base) + (int)slot;
}

/* Thread i's share of a call on n threads (ratio[0..n) sums to 1); a thread
 * never measured counts as the mean of those that were, or all equal.
 * Returns the sum of the n weights. */
static double shares(table *t, int n, double *ratio) {
    double known = 0.0, sum = 0.0;
    int nknown = 0;
    for (int i = 0; i < n; i++)
        if (t->weight[i] > 0.0) known += t->weight[i], nknown++;
    for (int i = 0; i < n; i++) {
        if (t->weight[i] <= 0.0) t->weight[i] = nknown ? known / nknown : 1.0;
        sum += t->weight[i];
    }
    for (int i = 0; i < n; i++) ratio[i] = t->weight[i] / sum;
    return sum;
}

void ulb_sched_split(int family, int n, int64_t nwork, int64_t *begin, int64_t *end) {
    pthread_mutex_lock(&lock);
    double ratio[ULB_MAX_THREADS];
    shares(&tables[family], n, ratio);
    int64_t share[ULB_MAX_THREADS];
    double cum = 0.0;
    int64_t prev = 0;
    for (int i = 0; i < n; i++) {
        cum += static_split ? 1.0 / n : ratio[i];
        int64_t e = i == n - 1 ? nwork : (int64_t)(cum * (double)nwork + 0.5);
        if (e < prev) e = prev;
        if (e > nwork) e = nwork;
        share[i] = e - prev;
        prev = e;
    }
    /* Every thread keeps at least one unit when there are enough: a thread
     * given none is not measured, the table stops moving (see
     * ulb_sched_record), and a small-matrix family whose ratio rounds a
     * thread down to nothing would keep it idle for good. */
    if (nwork >= n)
        for (int i = 0; i < n; i++)
            while (share[i] < 1) {
                int big = 0;
                for (int j = 1; j < n; j++)
                    if (share[j] > share[big]) big = j;
                share[big]--;
                share[i]++;
            }
    prev = 0;
    for (int i = 0; i < n; i++) {
        begin[i] = prev;
        end[i] = prev += share[i];
    }
    pthread_mutex_unlock(&lock);
}

void ulb_sched_record(int family, int n, const int64_t *begin, const int64_t *end,
                      const double *us) {
    pthread_mutex_lock(&lock);
    table *t = &tables[family];
    double ratio[ULB_MAX_THREADS];
    const double scale = shares(t, n, ratio);
    t->nthreads = n;
    t->calls++;
    double speed[ULB_MAX_THREADS], total = 0.0, longest = 0.0;
    int measurable = 1;
    for (int i = 0; i < n; i++) {
        t->last_us[i] = us[i];
        if (us[i] > longest) longest = us[i];
        t->last_work[i] = end[i] - begin[i];
        if (t->last_work[i] <= 0 || us[i] <= 0.0) measurable = 0;
        else total += speed[i] = (double)t->last_work[i] / us[i];
    }
    if (measurable && !static_split) {
        const double gain = EMA_GAIN * (longest < FULL_GAIN_US ? longest / FULL_GAIN_US : 1.0);
        double sum = 0.0;
        for (int i = 0; i < n; i++) {
            double r = (1.0 - gain) * ratio[i] + gain * speed[i] / total;
            if (r < MIN_SHARE / n) r = MIN_SHARE / n;
            sum += ratio[i] = r;
        }
        /* Back to weights on the old scale, so that threads past n, not in
         * this call, keep their standing against these. */
        for (int i = 0; i < n; i++) t->weight[i] = scale * ratio[i] / sum;
    }
    pthread_mutex_unlock(&lock);
}

double ulb_sched_slowdown(int tid) { return slowdown[tid]; }

/* Held across fork() by the forking thread (threadpool.c), so that no thread
 * fork() does not copy holds it. */
void ulb_sched_before_fork(void) { pthread_mutex_lock(&lock); }
void ulb_sched_after_fork(void) { pthread_mutex_unlock(&lock); }

ulb_status ulb_sched_stats_get(int bits, ulb_isa isa, ulb_sched_stats *out) {
    if ((bits != 0 && family_base(bits) < 0) || (unsigned)isa >= ULB_ISA_COUNT) return ULB_ERR_FORMAT;
    pthread_mutex_lock(&lock);
    const table *t = &tables[bits == 0 ? ULB_SCHED_PROBE : ulb_sched_family(bits, isa)];
    memset(out, 0, sizeof *out);
    out->nthreads = t->nthreads;
    out->calls = t->calls;
    double sum = 0.0;
    for (int i = 0; i < t->nthreads; i++) sum += t->weight[i];
    for (int i = 0; i < t->nthreads; i++) {
        out->ratio[i] = t->weight[i] / sum;
        out->last_us[i] = t->last_us[i];
        out->last_panels[i] = t->last_work[i];
    }
    pthread_mutex_unlock(&lock);
    return ULB_OK;
}

void ulb_sched_reset(void) {
    pthread_mutex_lock(&lock);
    memset(tables, 0, sizeof tables);
    pthread_mutex_unlock(&lock);
}

void ulb_sched_set_static(int on) { static_split = on; }

ulb_status ulb_sched_set_slowdown(int tid, double factor) {
    if (tid < 0 || tid >= ULB_MAX_THREADS || !(factor >= 1.0 && factor <= ULB_SLOWDOWN_MAX)) return ULB_ERR_THREADS;
    slowdown[tid] = factor;
    return ULB_OK;
}
