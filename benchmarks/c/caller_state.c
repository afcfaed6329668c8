/* What a streamed weight read does to its caller's cached state: a buffer
 * of bench_cold_bytes (2 MiB pages under ULB_BENCH_HUGEPAGES=1) read slice by slice with
 * ulb_read_probe, each slice as one call, alone and with a dependent walk
 * over `lines` random lines of a 64 MiB heap in 4 KiB pages between calls,
 * standing for the interpreter and framework state a Python call touches.
 * Prints, per slice size, both read rates and the walk's microseconds per
 * call: a walk of lines still cached costs little, one that the slice
 * pushed out to DRAM pays a miss (and a page walk) per line. On the Xeon VM
 * of benchmarks/results (run X6), 200 lines, three runs: 1.2-2.0 us after
 * 0.25 MiB, 1.4-4.6 after 1 MiB, 10.6-21 after 4 MiB, 37-46 after 16 MiB,
 * so the stream evicts the caller's lines from L2 and L3 alike.
 * Usage: caller_state [lines threads rounds]. */
#include <stdint.h>

#include "cold_blobs.h"

#define HEAP_BYTES ((size_t)64 << 20)

int main(int argc, char **argv) {
    const int lines = argc > 1 ? atoi(argv[1]) : 200, threads = argc > 2 ? atoi(argv[2]) : 1;
    const int rounds = argc > 3 ? atoi(argv[3]) : 5;
    if (lines < 1 || threads < 1 || rounds < 1 || rounds > BENCH_MAX_ROUNDS) {
        fprintf(stderr, "usage: caller_state [lines threads rounds]\n");
        return 2;
    }
    /* On 2 MiB boundaries, as bench_cold_blobs' arena, so that the buffer's pages can be huge. */
    const size_t huge = 2u << 20, buffer_bytes = (size_t)bench_cold_bytes() / huge * huge;
    uint8_t *buf = aligned_alloc(huge, buffer_bytes);
    uint64_t *heap = aligned_alloc(huge, HEAP_BYTES);
    int64_t *at = malloc(lines * sizeof *at);
    if (!buf || !heap || !at) return 2;
    if (bench_page_advice()) madvise(buf, buffer_bytes, bench_page_advice());
    madvise(heap, HEAP_BYTES, MADV_NOHUGEPAGE);
    memset(buf, 1, buffer_bytes);
    /* A cycle through `lines` random lines of the heap, each holding the next's word index. */
    srand(1);
    for (int i = 0; i < lines; i++) at[i] = ((int64_t)rand() * 7919 + rand()) % (HEAP_BYTES / 64) * 8;
    for (int i = 0; i < lines; i++) heap[at[i]] = (uint64_t)at[(i + 1) % lines];

    const double mib[] = {0.25, 1, 4, 16};
    uint64_t sink = 0, checksum;
    printf("slices of a %.0f MiB buffer, %d thread(s), a walk over %d lines between calls with it\n",
           buffer_bytes / 1048576.0, threads, lines);
    for (int s = 0; s < 4; s++) {
        const int64_t n = (int64_t)(mib[s] * 1048576), calls = (int64_t)buffer_bytes / n;
        double alone[BENCH_MAX_ROUNDS], with[BENCH_MAX_ROUNDS], walk[BENCH_MAX_ROUNDS];
        for (int r = 0; r < rounds; r++) {
            double t0 = bench_now_s();
            for (int64_t i = 0; i < calls; i++) {
                if (ulb_read_probe(buf + i * n, n, threads, &checksum)) return 2;
                sink += checksum;
            }
            alone[r] = calls * n / (bench_now_s() - t0) / 1e9;
            double walked = 0;
            t0 = bench_now_s();
            for (int64_t i = 0; i < calls; i++) {
                const double w0 = bench_now_s();
                uint64_t p = (uint64_t)at[0];
                for (int k = 0; k < lines; k++) p = heap[p];
                sink += p;
                walked += bench_now_s() - w0;
                if (ulb_read_probe(buf + i * n, n, threads, &checksum)) return 2;
                sink += checksum;
            }
            with[r] = calls * n / (bench_now_s() - t0) / 1e9;
            walk[r] = walked / calls * 1e6;
        }
        printf("  %5.2f MiB slices: %5.1f GB/s alone, %5.1f with the walk, walk %6.2f us a call (medians)\n",
               mib[s], bench_median(alone, rounds), bench_median(with, rounds), bench_median(walk, rounds));
    }
    return sink == 42; /* keeps the walks */
}
