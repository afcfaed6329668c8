/* The read probe's loop (probe.c) with 32-byte loads, for CPUs whose best
 * ISA is AVX2 or AVX-VNNI: on a Zen 3 it streams faster than the plain loop's
 * 8- and 16-byte loads (benchmarks/c/read_widths.c), fewer loads a line
 * keeping more lines in flight. Same checksum: the sum of the 8-byte words
 * modulo 2^64. */
#pragma GCC target("avx2")
#include <immintrin.h>

#include "../src/internal.h"

uint64_t ulb_probe_sum_avx2(const uint64_t *q, int64_t words, int streams, int64_t dist) {
    const uint8_t *end = (const uint8_t *)(q + words);
    const int64_t run = ulb_probe_run_words(words, streams);
    __m256i a = _mm256_setzero_si256(), b = a;
    for (int64_t i = 0; i < run; i += 8) /* a line of each run in turn */
        for (int r = 0; r < streams; r++) {
            const uint64_t *l = q + r * run + i;
            ulb_prefetch_ahead((const uint8_t *)l, dist, end);
            a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)l));
            b = _mm256_add_epi64(b, _mm256_loadu_si256((const __m256i *)(l + 4)));
        }
    a = _mm256_add_epi64(a, b);
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    uint64_t s = (uint64_t)_mm_cvtsi128_si64(h) + (uint64_t)_mm_extract_epi64(h, 1);
    for (int64_t i = streams * run; i < words; i++) s += q[i];
    return s;
}
