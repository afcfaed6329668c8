/* fork() while another thread makes parallel calls, its process's first
 * among them. Each trial forks a fresh process that has not used the pool
 * yet; in it a second thread starts making parallel jobs while the main
 * thread forks 0 to 1.95 ms later, before, during or after the pool's start.
 * The grandchild then runs parallel jobs of its own: a child that kept the
 * parent's worker count without its worker threads (fork copies only the
 * forking thread) would wait for its first job's workers for good, which
 * alarm() turns into a failure here (it did, with the reset in the pool's
 * child handler left out). Every job also checks that each unit of work ran
 * once. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../../kernels/src/internal.h"
#include "../../kernels/src/sched.h"

#define TRIALS 200
#define UNITS 8

static _Atomic int stop;

static void mark_units(void *ctx, int64_t begin, int64_t end) {
    _Atomic int *runs = ctx;
    for (int64_t u = begin; u < end; u++) atomic_fetch_add(&runs[u], 1);
}

/* One 2-thread job: whether every unit ran once. */
static int job_ok(void) {
    _Atomic int runs[UNITS] = {0};
    if (ulb_parallel(ULB_SCHED_PROBE, 2, UNITS, mark_units, runs) != ULB_OK) return 0;
    for (int u = 0; u < UNITS; u++)
        if (runs[u] != 1) return 0;
    return 1;
}

static void *caller(void *arg) {
    (void)arg;
    while (!atomic_load(&stop)) job_ok();
    return NULL;
}

static void pause_ns(long ns) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do clock_gettime(CLOCK_MONOTONIC, &t);
    while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < ns);
}

/* The fresh process of one trial: 0 if its forked child ran its jobs. */
static int trial(int t) {
    pthread_t b;
    if (pthread_create(&b, NULL, caller, NULL)) return 1;
    pause_ns(t % 40 * 50000L); /* 0 to 1.95 ms into the other thread's calls, its first among them */
    const pid_t pid = fork();
    if (pid == 0) {
        alarm(5);
        int ok = 1;
        for (int j = 0; j < 16; j++) ok &= job_ok();
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    const int waited = pid > 0 && waitpid(pid, &status, 0) == pid;
    atomic_store(&stop, 1);
    pthread_join(b, NULL);
    if (!waited) return 1;
    if (WIFSIGNALED(status)) printf("trial %d: the child was killed by signal %d\n", t, WTERMSIG(status));
    return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

int main(void) {
    int fails = 0;
    for (int t = 0; t < TRIALS; t++) {
        fflush(stdout);
        const pid_t pid = fork();
        if (pid == 0) _exit(trial(t));
        int status = 0;
        fails += !(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    printf("%d passed, %d failed\n", TRIALS - fails, fails);
    return fails != 0;
}
