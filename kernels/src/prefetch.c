/* Software prefetch distance of the microkernels, per code width: chosen once,
 * at load, by CPU vendor, then overridable (env ULB_PREFETCH_<bits>BIT=bytes
 * at load, ulb_prefetch_set at any time). Results never depend on it.
 *
 * Defaults measured with a cold GEMV, the distances timed in turn in one
 * process (benchmarks/c/prefetch_sweep.c; numbers in benchmarks/README.md):
 * - 1 bit, every CPU: 16 KiB. The 1-bit kernels spend more instructions per
 *   byte and stream only with it (none: 0.50-0.66x on Zen 4). 8 KiB:
 *   0.98-1.00x on Zen 4 and on a Xeon; 32 KiB: 0.98x on Zen 4, on the Xeon
 *   1.02x on one thread and 0.92x on 16.
 * - 2, 4 and 8 bits on AMD: none. Zen 4's hardware prefetcher streams these
 *   kernels as well alone: 8 KiB ahead ranged 0.91-1.10x by shape (mean
 *   ~1.0 over the twelve decode shapes on 1 and 2 threads), 4 KiB 0.83-0.95x.
 * - 2, 4 and 8 bits on Intel: 8 KiB. On a 16-core Xeon VM, none runs 2-bit
 *   at 0.68-0.79x of it (one thread, 4 and 16 threads), 0.87x on a 0.5 MiB
 *   matrix on 16 threads; int4 0.83-0.84x, int8 0.87-0.90x; 4 and 16 KiB
 *   are within 0.97-1.05x of 8 KiB. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

#define PREFETCH_MAX_BYTES (1 << 20)
#define NWIDTHS 4
static const int WIDTHS[NWIDTHS] = {1, 2, 4, 8};

static _Atomic int64_t distance[NWIDTHS];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static int width_index(int bits) {
    for (int i = 0; i < NWIDTHS; i++)
        if (WIDTHS[i] == bits) return i;
    return -1;
}

static int valid_distance(int64_t bytes) { return bytes >= 0 && bytes <= PREFETCH_MAX_BYTES && bytes % 64 == 0; }

static int cpu_is_intel(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_is("intel");
#else
    return 0;
#endif
}

static void prefetch_init(void) {
    const int intel = cpu_is_intel();
    for (int i = 0; i < NWIDTHS; i++) {
        int64_t d = WIDTHS[i] == 1 ? 16384 : intel ? 8192 : 0;
        char name[32];
        snprintf(name, sizeof name, "ULB_PREFETCH_%dBIT", WIDTHS[i]);
        const char *env = getenv(name);
        if (env && *env) {
            char *end;
            const long long v = strtoll(env, &end, 10);
            if (!*end && valid_distance(v)) d = v; /* else ignored; ulbtorch.runtime warns */
        }
        atomic_store(&distance[i], d);
    }
}

int64_t ulb_prefetch_distance(int bits) {
    pthread_once(&once, prefetch_init);
    const int i = width_index(bits);
    return i < 0 ? -ULB_ERR_FORMAT : atomic_load(&distance[i]);
}

ulb_status ulb_prefetch_set(int bits, int64_t bytes) {
    pthread_once(&once, prefetch_init);
    const int i = width_index(bits);
    if (i < 0) return ULB_ERR_FORMAT;
    if (!valid_distance(bytes)) return ULB_ERR_SHAPE;
    atomic_store(&distance[i], bytes);
    return ULB_OK;
}
