/* Software prefetch distance of the microkernels, per code width: a fixed
 * distance, or "auto" (the default), resolved for each call by CPU vendor,
 * thread count and group length. Env ULB_PREFETCH_<bits>BIT=bytes|auto at
 * load, ulb_prefetch_set at any time. Results never depend on it. (The
 * AVX-512 kernel for several tokens of 1- and 2-bit codes, tokens_group_slots,
 * prefetches a panel ahead instead, and not at all at distance 0.)
 *
 * The automatic rule, chosen by timing cold GEMVs at each distance in turn in
 * one process (benchmarks/c/prefetch_sweep.c through the C API,
 * benchmarks/prefetch_ab.py through the op; the measurements are in
 * benchmarks/results/notes_from_code.md):
 * - 1 bit, every CPU: 16 KiB. The 1-bit kernels spend more instructions per
 *   byte and keep up with memory only with a prefetch.
 * - 2, 4 and 8 bits on Intel: 8 KiB; no prefetch there leaves the stream
 *   well short of the memory's speed.
 * - 2 bits on AMD from Zen 5 (family 1Ah) on: 8 KiB.
 * - Elsewhere (2 bits on Zen 4 and other vendors' CPUs, 4 and 8 bits on
 *   AMD): 8 KiB only when one thread runs the call and a panel's group
 *   holds at most 40 KiB of codes (K <= 2560 with per-channel 2-bit scales,
 *   any K with groups of 128 or less): the group step then comes often
 *   enough that the stream stalls behind it, and one core alone cannot hide
 *   that. On two threads, or with longer groups, the prefetch costs more
 *   than it gains there, so none.
 * - 2, 4 and 8 bits under the AVX2 kernels (and their AVX-VNNI build),
 *   every CPU: 8 KiB. Without vpdpbusd they spend about twice the
 *   instructions per byte of the AVX-512 ones and, like the 1-bit kernels,
 *   keep up with memory only with a prefetch.
 * Base-3 codes (ternary_base3) take the 2-bit setting and rule.
 * The read probe (probe.c) reads as the AVX-512 2-bit kernel does, whatever
 * the ISA: it stands for the memory, not for a kernel. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define SHORT_GROUP_BYTES (40 << 10)
#define NWIDTHS 4
static const int WIDTHS[NWIDTHS] = {1, 2, 4, 8};

static _Atomic int64_t setting[NWIDTHS]; /* bytes, or ULB_PREFETCH_AUTO */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static int width_index(int bits) {
    for (int i = 0; i < NWIDTHS; i++)
        if (WIDTHS[i] == bits) return i;
    return -1;
}

static int valid_setting(int64_t bytes) {
    return bytes == ULB_PREFETCH_AUTO || (bytes >= 0 && bytes <= ULB_PREFETCH_MAX && bytes % 64 == 0);
}

static void prefetch_init(void) {
    for (int i = 0; i < NWIDTHS; i++) {
        int64_t d = ULB_PREFETCH_AUTO;
        char name[32];
        snprintf(name, sizeof name, "ULB_PREFETCH_%dBIT", WIDTHS[i]);
        const char *env = getenv(name);
        if (env && *env && strcmp(env, "auto")) {
            char *end;
            const long long v = strtoll(env, &end, 10);
            if (!*end && v >= 0 && valid_setting(v)) d = v; /* else ignored; ulbtorch.runtime warns */
        }
        atomic_store(&setting[i], d);
    }
}

ulb_status ulb_prefetch_get(int bits, int64_t *bytes) {
    pthread_once(&once, prefetch_init);
    const int i = width_index(bits);
    if (i < 0) return ULB_ERR_FORMAT;
    if (!bytes) return ULB_ERR_SHAPE;
    *bytes = atomic_load(&setting[i]);
    return ULB_OK;
}

ulb_status ulb_prefetch_set(int bits, int64_t bytes) {
    pthread_once(&once, prefetch_init);
    const int i = width_index(bits);
    if (i < 0) return ULB_ERR_FORMAT;
    if (!valid_setting(bytes)) return ULB_ERR_SHAPE;
    atomic_store(&setting[i], bytes);
    return ULB_OK;
}

int64_t ulb_prefetch_resolve_for(ulb_isa isa, int bits, int nthreads, int64_t group_code_bytes) {
    if (bits == ULB_BASE3_BITS) bits = 2; /* a byte of codes per 20 or 16 weights' columns of a row: the 2-bit setting */
    int64_t d;
    if (ulb_prefetch_get(bits, &d) != ULB_OK) return 0;
    if (d != ULB_PREFETCH_AUTO) return d;
    if (bits == 1) return 16384;
    if (ulb_cpu_intel() || isa == ULB_ISA_AVX2 || isa == ULB_ISA_AVXVNNI) return 8192;
    if (bits == 2 && ulb_cpu_amd_family() > 0x19) return 8192;
    return nthreads <= 1 && group_code_bytes <= SHORT_GROUP_BYTES ? 8192 : 0;
}

int64_t ulb_prefetch_resolve(int bits, int nthreads, int64_t group_code_bytes) {
    return ulb_prefetch_resolve_for(ulb_isa_active(), bits, nthreads, group_code_bytes);
}
