/* Persistent worker pool for microsecond-long calls: workers spin for a short
 * while after a job (env ULB_SPIN_US, default 200) and then sleep on a futex,
 * so back-to-back layers pay no wake-up while an idle process burns no CPU.
 * Each worker sleeps on a word of its own, and a job wakes only the workers
 * it needs: a worker left out of a job goes back to sleep without spinning.
 * Spinning threads yield the CPU every few microseconds, so that where there
 * are more threads than CPUs a spinner does not hold off the thread it waits
 * for. The calling thread is worker 0. One job at a time: a second caller
 * that finds the pool busy runs its job on its own thread. A host runner (see
 * ulb_set_parallel_runner) replaces the workers but keeps split and timing. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "sched.h"

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
#else
    (void)addr, (void)expected;
    sched_yield();
#endif
}

static void futex_wake_one(_Atomic uint32_t *addr) {
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#else
    (void)addr;
#endif
}

/* Spin-wait steps between looks at the clock, and how long a spinner runs
 * before it yields at each look: sched_yield returns at once when the CPU
 * has nothing else to run. */
#define SPINS_PER_CHECK 256
#define YIELD_AFTER_US 20.0

ulb_spin_wait ulb_spin_start(void) { return (ulb_spin_wait){now_us(), 0}; }

void ulb_spin_step(ulb_spin_wait *w) {
    ulb_cpu_relax();
    if (++w->spins % SPINS_PER_CHECK == 0 && now_us() - w->start_us > YIELD_AFTER_US) sched_yield();
}

/* pool.gen = (job counter << 8) | threads taking part in that job. */
#define JOB_THREADS_MASK 0xffu
#define JOB_COUNTER_STEP 0x100u

static struct {
    pthread_mutex_t lock; /* held by the caller for the whole job */
    int nworkers;         /* started workers, tids 1..nworkers */
    double spin_us;
    _Atomic uint32_t gen; /* published job: counter and thread count, see above */
    _Atomic int pending;  /* workers still running the job */
    /* 1 while worker tid is asleep or about to be (its futex word) */
    _Atomic uint32_t asleep[ULB_MAX_THREADS];
    uint32_t start_gen[ULB_MAX_THREADS];
    /* the job */
    ulb_range_fn fn;
    void *ctx;
    int64_t begin[ULB_MAX_THREADS], end[ULB_MAX_THREADS];
    double us[ULB_MAX_THREADS];
    double published_us;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .spin_us = -1.0};

/* A thread's time runs from the job's publication, not from when it got
 * going: a worker the OS scheduled late is as slow as one that computes
 * slowly, and the split must see both. */
static _Atomic(ulb_runner_fn) host_runner;

void ulb_set_parallel_runner(ulb_runner_fn runner) { atomic_store(&host_runner, runner); }

static void run_share(int tid) {
    const double t0 = now_us();
    if (pool.end[tid] > pool.begin[tid]) pool.fn(pool.ctx, pool.begin[tid], pool.end[tid]);
    const double slow = ulb_sched_slowdown(tid);
    if (slow > 1.0) {
        const double until = t0 + (now_us() - t0) * slow;
        while (now_us() < until) ulb_cpu_relax();
    }
    pool.us[tid] = now_us() - pool.published_us;
}

static void run_share_task(void *ctx, int tid) {
    (void)ctx;
    run_share(tid);
}

static void *worker_main(void *arg) {
    const int tid = (int)(intptr_t)arg;
    /* The generation before any job this worker must run: read by the
     * creator, since a job may be published before this thread starts. */
    uint32_t seen = pool.start_gen[tid];
    double spin_for = pool.spin_us;
    for (;;) {
        uint32_t g;
        ulb_spin_wait w = ulb_spin_start();
        while ((g = atomic_load_explicit(&pool.gen, memory_order_acquire)) == seen) {
            ulb_spin_step(&w);
            if (w.spins % SPINS_PER_CHECK || now_us() - w.start_us < spin_for) continue;
            /* seq_cst, as the caller's publication: either this load sees
             * the new job or the caller sees asleep = 1 and wakes us. The
             * fence spells out the store-before-load order that seq_cst
             * already implies: qemu-user on an x86 host keeps it only for a
             * fence (its aarch64 stlr, ldar pair lets the load pass the
             * store, and a worker slept through its job for good). */
            atomic_store(&pool.asleep[tid], 1);
            atomic_thread_fence(memory_order_seq_cst);
            if (atomic_load(&pool.gen) == seen) futex_wait(&pool.asleep[tid], 1);
            atomic_store(&pool.asleep[tid], 0);
            w = ulb_spin_start();
        }
        seen = g;
        /* Who takes part travels in the same word as the generation, so a
         * worker that wakes late can never mistake a later job for this one. */
        const int takes_part = tid < (int)(g & JOB_THREADS_MASK);
        if (takes_part) {
            run_share(tid);
            atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
        }
        spin_for = takes_part ? pool.spin_us : 0.0;
    }
    return NULL;
}

/* fork() copies only the calling thread: a lock another thread held at that
 * moment would stay locked in the child for good. So the forking thread
 * takes the pool's lock (waiting out a running job) and the scheduler's
 * around fork, in the order ulb_parallel takes them. */
static void before_fork(void) {
    pthread_mutex_lock(&pool.lock);
    ulb_sched_before_fork();
}

static void after_fork_parent(void) {
    ulb_sched_after_fork();
    pthread_mutex_unlock(&pool.lock);
}

static void after_fork_child(void) {
    /* Worker threads do not survive fork(); start afresh in the child. */
    ulb_sched_after_fork();
    pool.nworkers = 0;
    for (int t = 0; t < ULB_MAX_THREADS; t++) atomic_store(&pool.asleep[t], 0);
    atomic_store(&pool.pending, 0);
    pthread_mutex_unlock(&pool.lock);
}

/* ULB_SPIN_US: 0 to 1e6 microseconds; anything else (empty, not a number,
 * inf, which would spin for ever) is the default, 200 (ulb_spin_us says so). */
#define SPIN_US_DEFAULT 200.0
#define SPIN_US_MAX 1e6
static int spin_us_from_env(const char *env, double *us) {
    *us = SPIN_US_DEFAULT;
    if (!env) return 1;
    if (!*env || strspn(env, "0123456789.eE+-") != strlen(env)) return 0;
    char *end;
    const double v = strtod(env, &end);
    if (end == env || *end != '\0' || !(v >= 0.0 && v <= SPIN_US_MAX)) return 0;
    *us = v;
    return 1;
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_init(void) {
    spin_us_from_env(getenv("ULB_SPIN_US"), &pool.spin_us);
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

double ulb_spin_us(int *env_accepted) {
    double us;
    const int accepted = spin_us_from_env(getenv("ULB_SPIN_US"), &us);
    if (env_accepted) *env_accepted = accepted;
    return us;
}

/* Returns how many threads can take part (>= 1). */
static int ensure_workers(int nthreads) {
    while (pool.nworkers < nthreads - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.start_gen[pool.nworkers + 1] = atomic_load(&pool.gen);
        int rc = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)(pool.nworkers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.nworkers++;
    }
    return pool.nworkers + 1 < nthreads ? pool.nworkers + 1 : nthreads;
}

ulb_status ulb_parallel(int family, int nthreads, int64_t nwork, ulb_range_fn fn, void *ctx) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > ULB_MAX_THREADS) nthreads = ULB_MAX_THREADS;
    if (nthreads > nwork) nthreads = nwork > 0 ? (int)nwork : 1;
    pthread_once(&pool_once, pool_init);
    if (nthreads == 1 || pthread_mutex_trylock(&pool.lock) != 0) {
        if (nwork > 0) fn(ctx, 0, nwork);
        return ULB_OK;
    }
    const ulb_runner_fn runner = atomic_load(&host_runner);
    if (!runner) nthreads = ensure_workers(nthreads);
    pool.fn = fn;
    pool.ctx = ctx;
    ulb_sched_split(family, nthreads, nwork, pool.begin, pool.end);
    pool.published_us = now_us();
    if (runner) {
        runner(nthreads, run_share_task, NULL);
    } else {
        atomic_store(&pool.pending, nthreads - 1);
        const uint32_t prev = atomic_load(&pool.gen);
        /* seq_cst, and fenced as the worker's side: the publication must be
         * ordered before reading asleep. */
        atomic_store(&pool.gen, ((prev & ~JOB_THREADS_MASK) + JOB_COUNTER_STEP) | (uint32_t)nthreads);
        atomic_thread_fence(memory_order_seq_cst);
        for (int t = 1; t < nthreads; t++)
            if (atomic_exchange(&pool.asleep[t], 0)) futex_wake_one(&pool.asleep[t]);
        run_share(0);
        ulb_spin_wait w = ulb_spin_start();
        while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) ulb_spin_step(&w);
    }
    ulb_sched_record(family, nthreads, pool.begin, pool.end, pool.us);
    pthread_mutex_unlock(&pool.lock);
    return ULB_OK;
}
