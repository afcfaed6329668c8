/* The packed blob's checksum (blob version 3): XXH64 with seed 0 over the
 * whole blob, its checksum field read as zero, of which the field keeps the
 * low 32 bits. XXH64 runs at memory speed in portable C, one pass, and its
 * published test vectors pin this implementation (tests/test_checkpoint_integrity.py). */
#include <stddef.h>
#include <string.h>

#include "internal.h"

#define P1 0x9E3779B185EBCA87ull
#define P2 0xC2B2AE3D27D4EB4Full
#define P3 0x165667B19E3779F9ull
#define P4 0x85EBCA77C2B2AE63ull
#define P5 0x27D4EB2F165667C5ull
#define STRIPE 32
_Static_assert(ULB_HEADER_BYTES % STRIPE == 0, "the header is hashed as whole stripes");

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint64_t round64(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }

static inline uint64_t merge(uint64_t h, uint64_t v) { return (h ^ round64(0, v)) * P1 + P4; }

/* The four lanes over whole stripes of p (n a multiple of STRIPE). */
static void stripes(uint64_t v[4], const uint8_t *p, size_t n) {
    for (const uint8_t *end = p + n; p < end; p += STRIPE) {
        v[0] = round64(v[0], read64(p));
        v[1] = round64(v[1], read64(p + 8));
        v[2] = round64(v[2], read64(p + 16));
        v[3] = round64(v[3], read64(p + 24));
    }
}

/* The hash of `total` bytes whose stripes went into v (none when total <
 * STRIPE), ending with the `n` bytes at tail. */
static uint64_t finish(const uint64_t v[4], uint64_t seed, uint64_t total, const uint8_t *tail, size_t n) {
    uint64_t h = seed + P5;
    if (total >= STRIPE) {
        h = rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18);
        for (int i = 0; i < 4; i++) h = merge(h, v[i]);
    }
    h += total;
    const uint8_t *p = tail, *end = tail + n;
    for (; p + 8 <= end; p += 8) h = rotl(h ^ round64(0, read64(p)), 27) * P1 + P4;
    if (p + 4 <= end) {
        uint32_t w;
        memcpy(&w, p, sizeof w);
        h = rotl(h ^ (uint64_t)w * P1, 23) * P2 + P3;
        p += 4;
    }
    for (; p < end; p++) h = rotl(h ^ *p * P5, 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    return h ^ (h >> 32);
}

static void lanes_init(uint64_t v[4], uint64_t seed) {
    v[0] = seed + P1 + P2;
    v[1] = seed + P2;
    v[2] = seed;
    v[3] = seed - P1;
}

uint64_t ulb_xxh64(const void *data, int64_t n, uint64_t seed) {
    const uint8_t *p = data;
    const size_t whole = n >= STRIPE ? (size_t)n / STRIPE * STRIPE : 0;
    uint64_t v[4];
    lanes_init(v, seed);
    stripes(v, p, whole);
    return finish(v, seed, (uint64_t)n, p + whole, (size_t)n - whole);
}

uint32_t ulb_blob_checksum(const uint8_t *blob, int64_t nbytes) {
    /* The header's two stripes from a copy with the field zeroed, then the rest
     * in place: every blob is longer than its header by whole lines. */
    uint8_t head[ULB_HEADER_BYTES];
    memcpy(head, blob, sizeof head);
    memset(head + offsetof(ulb_header, checksum), 0, sizeof(uint32_t));
    const size_t rest = (size_t)nbytes - ULB_HEADER_BYTES, whole = rest / STRIPE * STRIPE;
    uint64_t v[4];
    lanes_init(v, 0);
    stripes(v, head, sizeof head);
    stripes(v, blob + ULB_HEADER_BYTES, whole);
    return (uint32_t)finish(v, 0, (uint64_t)nbytes, blob + ULB_HEADER_BYTES + whole, rest - whole);
}
