/* fork() while another thread keeps the pool busy: the child, which has one
 * thread, must find the pool's and the scheduler's locks free, start its own
 * workers and get the one-thread result (threadpool.c's fork handlers). A
 * hung child fails the test by timeout. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ulb/ulb.h"

#define M 512
#define K 1024
#define FORKS 30

static uint8_t *blob;
static int64_t nbytes;
static float x[K], want[M];
static atomic_int stop;

static int wrong(int threads) {
    float y[M];
    return ulb_linear(blob, nbytes, 1, x, ULB_DT_F32, K, 1, NULL, ULB_DT_F32, y, ULB_DT_F32, M, threads) ||
           memcmp(y, want, sizeof y);
}

static void *keep_busy(void *arg) {
    (void)arg;
    while (!atomic_load(&stop)) wrong(2);
    return NULL;
}

/* 0 once the child exits cleanly, 1 if it fails or runs past 5 s. */
static int child_failed(pid_t pid) {
    for (int i = 0; i < 500; i++) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) return !WIFEXITED(st) || WEXITSTATUS(st) != 0;
        nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return 1;
}

int main(void) {
    static uint8_t codes[M * K];
    static float scales[M];
    for (int i = 0; i < M * K; i++) codes[i] = (uint8_t)(i * 7 % 4);
    for (int i = 0; i < M; i++) scales[i] = 0.01f * (float)(i % 13 + 1);
    for (int k = 0; k < K; k++) x[k] = (float)((k * 37) % 101 - 50);
    nbytes = ulb_packed_nbytes(ULB_FMT_INT2, M, K, 0);
    blob = malloc((size_t)nbytes);
    if (!blob || ulb_pack(ULB_FMT_INT2, M, K, 0, codes, K, scales, blob, nbytes) ||
        ulb_linear(blob, nbytes, 1, x, ULB_DT_F32, K, 1, NULL, ULB_DT_F32, want, ULB_DT_F32, M, 1)) {
        printf("setup failed\n");
        return 1;
    }
    int fails = wrong(2);
    pthread_t busy;
    pthread_create(&busy, NULL, keep_busy, NULL);
    for (int i = 0; i < FORKS; i++) {
        const pid_t pid = fork();
        if (pid == 0) {
            int bad = 0;
            for (int j = 0; j < 20; j++) bad |= wrong(2 + j % 2);
            _exit(bad);
        }
        fails += pid < 0 || child_failed(pid);
    }
    atomic_store(&stop, 1);
    pthread_join(busy, NULL);
    printf("%d passed, %d failed\n", FORKS + 1 - fails, fails);
    return fails != 0;
}
