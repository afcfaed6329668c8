/* Body of the AVX2 microkernels (1-, 2-, 4- and 8-bit codes) for CPUs
 * without AVX-512 (and for 1-bit LANES blobs on CPUs with it), compiled
 * twice: panel_avx2.c (ULB_AVX2_VNNI 0) and panel_avxvnni.c (ULB_AVX2_VNNI 1), each under its own target, which names
 * the entry point ULB_PANEL_AVX2_FN.
 * u8 codes x s8 activations with vpmaddubsw + vpmaddwd, or with AVX-VNNI's
 * vpdpbusd for the fields of 1-, 2- and 4-bit codes. One 16-row tile at a
 * time (two 8-row halves), so each pass reads one sequential stream.
 * Exact in 16 bits: the products of all fields of a half tile are summed in
 * 16 bits before widening: at most 4 * 2*3*128 = 3072 (2-bit),
 * 8 * 2*1*128 = 2048 (1-bit, several tokens; one token: one_token_1bit) or
 * 2 * 2*15*128 = 7680 (4-bit) in magnitude. 8-bit codes (up to 254) would
 * saturate vpmaddubsw's pair sums, so they go in as two nibbles, q = lo +
 * 16 hi, each pair sum at most 2*15*128. Must match ref/panel_ref.c bit for
 * bit. */
#include <immintrin.h>
#include <string.h>

#include "../src/internal.h"

#if ULB_AVX2_VNNI
/* acc + the four u8 x s8 products of each dword, in 32 bits (vpdpbusd). */
ALWAYS_INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i x) {
#ifdef ULB_EMULATE_AVXVNNI
    /* The same sums from AVX2 alone, for testing where AVX-VNNI is absent:
     * even and odd bytes widened to 16 bits (u zero-, x sign-extended), each
     * pair summed exactly by vpmaddwd. */
    const __m256i lo8 = _mm256_set1_epi16(0x00FF);
    const __m256i even = _mm256_madd_epi16(_mm256_and_si256(u, lo8), _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8));
    const __m256i odd = _mm256_madd_epi16(_mm256_srli_epi16(u, 8), _mm256_srai_epi16(x, 8));
    return _mm256_add_epi32(acc, _mm256_add_epi32(even, odd));
#else
    return _mm256_dpbusd_avx_epi32(acc, u, x);
#endif
}
#endif

ALWAYS_INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* Half h (rows 8h .. 8h + 7) of a tile in VNNI order: loaded as is, or
 * from a LANES tile (layout.h), whose byte slots b = 0..3 are its four
 * 16-byte lanes, by a byte transpose: unpacking the two 32-byte halves
 * interleaves slots 0 with 2 and 1 with 3 (rows 0-7 low, 8-15 high), vpermq
 * puts a quarter of each pair side by side in a lane, and vpshufb orders each
 * row's four bytes. */
ALWAYS_INLINE __m256i tile_half(const uint8_t *tile, int h, const int lanes) {
    if (!lanes) return _mm256_loadu_si256((const __m256i *)(tile + 32 * h));
    const __m256i order = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 8, 1, 9, 2, 10,
                                           3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m256i s01 = _mm256_loadu_si256((const __m256i *)tile);
    const __m256i s23 = _mm256_loadu_si256((const __m256i *)(tile + 32));
    const __m256i pairs = h ? _mm256_unpackhi_epi8(s01, s23) : _mm256_unpacklo_epi8(s01, s23);
    return _mm256_shuffle_epi8(_mm256_permute4x64_epi64(pairs, 0xD8), order);
}

/* Field f of a half tile brought down to 0..(2^bits - 1): the VNNI4 u8
 * operand of k-quad f for 8 rows. */
ALWAYS_INLINE __m256i field(__m256i v, int f, const int bits) {
    const __m256i mask = _mm256_set1_epi8((char)((1 << bits) - 1));
    return _mm256_and_si256(f ? _mm256_srli_epi16(v, bits * f) : v, mask);
}

/* One token, 1-bit codes, one group: acc[t][h] = sum over k-steps [ks0, ks1)
 * of q . x for the 8 rows of half h of tile t. Bit s of a byte masked in
 * place is 2^s q, so fields s and 4 + s (the latter from v >> 4) share slot
 * s: four 16-bit slot sums per half tile, no shift per field, each scaled
 * back exactly (an arithmetic shift of a multiple of 2^s) when widened. Slot
 * 3 gains from -4096 (all x = -128) to 4064 per k-step, so 8 k-steps fit
 * 16 bits exactly (tests/test_kernels.py, extremes): the loop runs tile by
 * tile over chunks of 8. 25 vector operations per 32 bytes of codes instead
 * of 32, which shows on Zen 3 (kernel_hot), where logic, adds and multiplies
 * share three pipes. Broadcasting a chunk's activations once into memory for
 * all its tiles, or taking the halves of a tile one at a time (no spills),
 * were slower; other 1-bit kernels tried: benchmarks/results, Zen 3. */
#define ONE_BIT_CHUNK 8
ALWAYS_INLINE void one_token_1bit(const uint8_t *codes, int64_t ks0, int64_t ks1, const int nt, const int8_t *x,
                                  int64_t pf_dist, const uint8_t *pf_end, __m256i acc[ULB_PANEL_TILES][2],
                                  const int lanes) {
    const __m256i ones16 = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
    for (int64_t c0 = ks0; c0 < ks1; c0 += ONE_BIT_CHUNK) {
        const int64_t c1 = c0 + ONE_BIT_CHUNK < ks1 ? c0 + ONE_BIT_CHUNK : ks1;
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m256i slot[2][4];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) slot[h][0] = slot[h][1] = slot[h][2] = slot[h][3] = _mm256_setzero_si256();
            for (int64_t ks = c0; ks < c1; ks++) {
                const uint8_t *tile = codes + ((ks - ks0) * nt + t) * ULB_TILE_BYTES;
                ulb_prefetch_ahead(tile, pf_dist, pf_end);
                const int8_t *xk = x + ks * 32;
                const __m256i v0 = tile_half(tile, 0, lanes), v1 = tile_half(tile, 1, lanes);
                const __m256i hi0 = _mm256_srli_epi16(v0, 4), hi1 = _mm256_srli_epi16(v1, 4);
#pragma GCC unroll 4
                for (int s = 0; s < 4; s++) {
                    const __m256i m = _mm256_set1_epi8((char)(1 << s));
                    const __m256i xl = bcast4(xk + 4 * s), xh = bcast4(xk + 16 + 4 * s);
                    slot[0][s] = _mm256_add_epi16(slot[0][s], _mm256_maddubs_epi16(_mm256_and_si256(v0, m), xl));
                    slot[1][s] = _mm256_add_epi16(slot[1][s], _mm256_maddubs_epi16(_mm256_and_si256(v1, m), xl));
                    slot[0][s] = _mm256_add_epi16(slot[0][s], _mm256_maddubs_epi16(_mm256_and_si256(hi0, m), xh));
                    slot[1][s] = _mm256_add_epi16(slot[1][s], _mm256_maddubs_epi16(_mm256_and_si256(hi1, m), xh));
                }
            }
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256i c = _mm256_add_epi16(
                    _mm256_add_epi16(slot[h][0], _mm256_srai_epi16(slot[h][1], 1)),
                    _mm256_add_epi16(_mm256_srai_epi16(slot[h][2], 2), _mm256_srai_epi16(slot[h][3], 3)));
                acc[t][h] = _mm256_add_epi32(acc[t][h], _mm256_madd_epi16(c, ones16));
            }
        }
    }
}

/* One token, 2- or 4-bit codes, one group of np panels (codes[q]):
 * acc[q][t][h] as tiles_body's field loop makes it, but the products summed
 * in 16 bits over chunks of k-steps and widened once a chunk, not once a
 * k-step (one vector operation fewer per half tile and k-step): a k-step adds
 * at most fields * 2*(2^bits - 1)*128 in magnitude, 3072 (2-bit) or 7680
 * (4-bit), so chunks of 10 or 4 fit. K-step by k-step over all tiles, so each
 * panel is still read as one stream; with np = 2, one k-step of each in turn
 * (see ulb_panel_pair_fn). Faster in cache on Zen 3 (kernel_hot), and no
 * slower cold (ab_builds.sh). */
ALWAYS_INLINE void one_token_fields(const uint8_t *const *codes, const int np, int64_t ks0, int64_t ks1,
                                    const int nt, const int8_t *x, int64_t pf_dist, const uint8_t *pf_end,
                                    __m256i acc[][ULB_PANEL_TILES][2], const int bits) {
    const int fields = 8 / bits, chunk = 32767 / (fields * 2 * ((1 << bits) - 1) * 128);
    const __m256i ones16 = _mm256_set1_epi16(1);
#pragma GCC unroll 2
    for (int q = 0; q < np; q++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) acc[q][t][0] = acc[q][t][1] = _mm256_setzero_si256();
    for (int64_t c0 = ks0; c0 < ks1; c0 += chunk) {
        const int64_t c1 = c0 + chunk < ks1 ? c0 + chunk : ks1;
        __m256i sum[ULB_PANEL_PAIR][ULB_PANEL_TILES][2];
#pragma GCC unroll 2
        for (int q = 0; q < np; q++)
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) sum[q][t][0] = sum[q][t][1] = _mm256_setzero_si256();
        for (int64_t ks = c0; ks < c1; ks++)
#pragma GCC unroll 2
            for (int q = 0; q < np; q++)
#pragma GCC unroll 4
                for (int t = 0; t < nt; t++)
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        const uint8_t *half = codes[q] + ((ks - ks0) * nt + t) * ULB_TILE_BYTES + 32 * h;
                        if (h == 0) ulb_prefetch_ahead(half, pf_dist, pf_end);
                        const __m256i v = _mm256_loadu_si256((const __m256i *)half);
#pragma GCC unroll 4
                        for (int f = 0; f < fields; f++)
                            sum[q][t][h] = _mm256_add_epi16(
                                sum[q][t][h],
                                _mm256_maddubs_epi16(field(v, f, bits), bcast4(x + ks * 4 * fields + 4 * f)));
                    }
#pragma GCC unroll 2
        for (int q = 0; q < np; q++)
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++)
                    acc[q][t][h] = _mm256_add_epi32(acc[q][t][h], _mm256_madd_epi16(sum[q][t][h], ones16));
    }
}

/* Tiles [t0, t0 + tc) of panel ps[0] (nt tiles per k-step), nb tokens, into
 * faccs[0]; or, with np = 2, one token through full panels ps[0] and ps[1]
 * (2-, 4- or 8-bit codes, or 1-bit LANES tiles with tables), into faccs[0]
 * and faccs[1]. One token takes all tiles of a k-step at once, reading a
 * panel as the single stream it is; several tokens take one tile at a time
 * so their accumulators stay in the 16 registers. A job j is token j of the panel, or with np = 2 the token
 * through panel j: out and acc are per job. */
ALWAYS_INLINE void tiles_body(const ulb_weight *w, const int64_t *ps, const int np, int nt, int t0, const int tc,
                              const ulb_acts *a, int64_t n0, float *const *faccs, int32_t *dots, const int nb,
                              const int bits, const int prefetch, const int lanes) {
    const int fields = 8 / bits, kt = 32 / bits, jobs = np > 1 ? np : nb;
    const int64_t pf_dist = prefetch ? a->prefetch_dist : 0; /* see panel_bits */
    const int8_t *x[ULB_NB_MAX];
    for (int j = 0; j < nb; j++) x[j] = a->xq + (n0 + j) * a->ldq;
    const __m256i ones16 = _mm256_set1_epi16(1), sixteens16 = _mm256_set1_epi16(16);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i va = _mm256_set1_epi32(w->level_a);
    __m256 out[ULB_NB_MAX][ULB_PANEL_TILES][2];
#pragma GCC unroll 4
    for (int j = 0; j < jobs; j++)
#pragma GCC unroll 4
        for (int t = 0; t < tc; t++) out[j][t][0] = out[j][t][1] = _mm256_setzero_ps();

    for (int64_t g = 0; g < w->n_groups; g++) {
        const int64_t ks0 = g * w->gsteps;
        const int64_t ks1 = ks0 + ulb_group_steps(w, g);
        const float *scales[ULB_PANEL_PAIR];
        const uint8_t *codes[ULB_PANEL_PAIR];
#pragma GCC unroll 2
        for (int q = 0; q < np; q++) {
            const uint8_t *group = ulb_group_base(w, ps[q], nt, g);
            scales[q] = (const float *)group;
            codes[q] = group + nt * ULB_TILE_SCALE_BYTES;
            /* As far ahead of the scales as the tile loop prefetches ahead of codes. */
            if (t0 == 0)
                for (int t = 0; t < nt; t++)
                    ulb_prefetch_ahead(group + t * ULB_TILE_SCALE_BYTES, pf_dist, a->prefetch_end);
        }
        __m256i acc[ULB_NB_MAX][ULB_PANEL_TILES][2];
#pragma GCC unroll 4
        for (int j = 0; j < jobs; j++)
#pragma GCC unroll 4
            for (int t = 0; t < tc; t++) acc[j][t][0] = acc[j][t][1] = _mm256_setzero_si256();
        /* With vpdpbusd the field loop below takes 23 operations per 32 bytes of
         * 1-bit codes, as few as the slots. */
        /* One token with tables: a LANES blob (the tables of VNNI tiles are
         * AVX-512's, whose kernel takes them). */
        if (bits == 1 && nb == 1 && lanes && a->lut1) {
            int32_t dot1[ULB_PANEL_PAIR][ULB_PANEL_ROWS] __attribute__((aligned(32)));
            const uint8_t *lut = a->lut1 + n0 * w->ksteps * ULB_LUT1_STEP_BYTES; /* token n0's tables */
            if (np == 2)
                ulb_lut1_lanes_pair_avx2(codes[0], codes[1], ks0, ks1, lut, pf_dist, a->prefetch_end, dot1[0],
                                         dot1[1]);
            else
                ulb_lut1_lanes_group_avx2(codes[0], ks0, ks1, tc, lut, pf_dist, a->prefetch_end, dot1[0]);
#pragma GCC unroll 2
            for (int q = 0; q < np; q++)
#pragma GCC unroll 4
                for (int t = 0; t < tc; t++)
                    for (int h = 0; h < 2; h++)
                        acc[q][t][h] = _mm256_load_si256((const __m256i *)(dot1[q] + 16 * t + 8 * h));
        } else if (bits == 1 && nb == 1 && np == 1 && !ULB_AVX2_VNNI)
            one_token_1bit(codes[0], ks0, ks1, tc, x[0], pf_dist, a->prefetch_end, acc[0], lanes);
        else if ((bits == 2 || bits == 4) && nb == 1 && !ULB_AVX2_VNNI)
            one_token_fields(codes, np, ks0, ks1, tc, x[0], pf_dist, a->prefetch_end, acc, bits);
        else for (int64_t ks = ks0; ks < ks1; ks++)
#pragma GCC unroll 2
            for (int q = 0; q < np; q++) /* acc[q + j]: job q with np = 2, else j */
#pragma GCC unroll 4
            for (int t = 0; t < tc; t++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const uint8_t *tile = codes[q] + ((ks - ks0) * nt + t0 + t) * ULB_TILE_BYTES;
                    if (h == 0) ulb_prefetch_ahead(tile, pf_dist, a->prefetch_end);
                    const __m256i v = tile_half(tile, h, lanes);
#if !ULB_AVX2_VNNI
                    __m256i p[ULB_NB_MAX];
#endif
                    if (bits == 8) {
                        const __m256i lo = _mm256_and_si256(v, nibble);
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#pragma GCC unroll 4
                        for (int j = 0; j < nb; j++) {
                            const __m256i xj = bcast4(x[j] + ks * kt);
                            acc[q + j][t][h] = _mm256_add_epi32(
                                acc[q + j][t][h],
                                _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xj), ones16),
                                                 _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xj), sixteens16)));
                        }
                        continue;
                    }
#pragma GCC unroll 8
                    for (int f = 0; f < fields; f++) {
                        const __m256i u = field(v, f, bits);
#pragma GCC unroll 4
                        for (int j = 0; j < nb; j++) {
#if ULB_AVX2_VNNI
                            acc[q + j][t][h] = dpbusd(acc[q + j][t][h], u, bcast4(x[j] + ks * kt + 4 * f));
#else
                            const __m256i pf = _mm256_maddubs_epi16(u, bcast4(x[j] + ks * kt + 4 * f));
                            p[j] = f ? _mm256_add_epi16(p[j], pf) : pf;
#endif
                        }
                    }
#if !ULB_AVX2_VNNI
#pragma GCC unroll 4
                    for (int j = 0; j < nb; j++)
                        acc[q + j][t][h] = _mm256_add_epi32(acc[q + j][t][h], _mm256_madd_epi16(p[j], ones16));
#endif
                }
#pragma GCC unroll 4
        for (int j = 0; j < jobs; j++) {
            const int64_t n = n0 + (np > 1 ? 0 : j); /* this job's token */
            const float *sc = scales[np > 1 ? j : 0];
            const __m256i vb = _mm256_set1_epi32(w->level_b * a->xsum[n * w->n_groups + g]);
#pragma GCC unroll 4
            for (int t = 0; t < tc; t++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const int64_t r = (t0 + t) * ULB_TILE + 8 * h; /* row within the panel */
                    const __m256i dot = _mm256_add_epi32(_mm256_mullo_epi32(acc[j][t][h], va), vb);
                    const __m256 s = _mm256_loadu_ps(sc + r);
                    out[j][t][h] = _mm256_add_ps(out[j][t][h], _mm256_mul_ps(s, _mm256_cvtepi32_ps(dot)));
                    if (dots)
                        _mm256_storeu_si256(
                            (__m256i *)(dots + (j * w->n_groups + g) * ULB_PANEL_ROWS + r), dot);
                }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < jobs; j++) {
        float *facc = np > 1 ? faccs[j] : faccs[0] + j * ULB_PANEL_ROWS;
#pragma GCC unroll 4
        for (int t = 0; t < tc; t++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(facc + (t0 + t) * ULB_TILE + 8 * h, out[j][t][h]);
    }
}

#define ULB_ONE_TOKEN(BITS, PF, LANES, NT)                                                         \
    case NT:                                                                                       \
        tiles_body(w, &p, 1, ntiles, 0, NT, a, n0, &facc, dots, 1, BITS, PF, LANES);               \
        return;

/* Token n0 through all tiles of panel p. */
ALWAYS_INLINE void one_token(const ulb_weight *w, int64_t p, int ntiles, const ulb_acts *a, int64_t n0, float *facc,
                             int32_t *dots, const int bits, const int prefetch, const int lanes) {
    switch (ntiles) {
        ULB_ONE_TOKEN(bits, prefetch, lanes, 1) ULB_ONE_TOKEN(bits, prefetch, lanes, 2)
        ULB_ONE_TOKEN(bits, prefetch, lanes, 3) ULB_ONE_TOKEN(bits, prefetch, lanes, 4)
    }
}
#define ULB_TOKENS(BITS, PF, LANES, NB)                                                            \
    case NB:                                                                                       \
        for (int t = 0; t < ntiles; t++)                                                           \
            tiles_body(w, &p, 1, ntiles, t, 1, a, n0, &facc, dots, NB, BITS, PF, LANES);           \
        return;

/* prefetch (a constant): whether to prefetch at all; without it the prefetch
 * code is compiled out (a zero distance tested in the tile loop slowed the
 * AVX-512 2-bit one-token loop on Zen 4). */
ALWAYS_INLINE void panel_bits(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0,
                              int nb, float *facc, int32_t *dots, const int bits, const int prefetch,
                              const int lanes) {
    const int64_t p = tile0 / ULB_PANEL_TILES;
    /* Several tokens with tables run a lookup pass each (the codes come from
     * cache after the first): 26 operations per tile and token, fewer than
     * masking shared by four tokens. */
    if (nb == 1 || (lanes && a->lut1)) {
        for (int j = 0; j < nb; j++)
            one_token(w, p, ntiles, a, n0 + j, facc + j * ULB_PANEL_ROWS,
                      dots ? dots + j * w->n_groups * ULB_PANEL_ROWS : NULL, bits, prefetch, lanes);
    } else {
        switch (nb) {
            ULB_TOKENS(bits, prefetch, lanes, 2) ULB_TOKENS(bits, prefetch, lanes, 3)
            ULB_TOKENS(bits, prefetch, lanes, 4)
        }
    }
}

/* panel_bits with the code width and tile order fixed, with and without
 * prefetch: NAME(bits, lanes). */
#define ULB_PANEL_FN(NAME, BITS, LANES)                                                            \
    static void NAME(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, \
                     int nb, float *facc, int32_t *dots) {                                         \
        if (a->prefetch_dist)                                                                      \
            panel_bits(w, tile0, ntiles, a, n0, nb, facc, dots, BITS, 1, LANES);                   \
        else                                                                                       \
            panel_bits(w, tile0, ntiles, a, n0, nb, facc, dots, BITS, 0, LANES);                   \
    }
ULB_PANEL_FN(panel_1bit_vnni, 1, 0)
ULB_PANEL_FN(panel_1bit_lanes, 1, 1)
ULB_PANEL_FN(panel_2bit, 2, 0)
ULB_PANEL_FN(panel_4bit, 4, 0)
ULB_PANEL_FN(panel_8bit, 8, 0)

static void panel_1bit(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb,
                       float *facc, int32_t *dots) {
    (w->tiles == ULB_TILES_LANES ? panel_1bit_lanes : panel_1bit_vnni)(w, tile0, ntiles, a, n0, nb, facc, dots);
}

#if !ULB_AVX2_VNNI
/* ulb_panel_pair_fn for 2-, 4- and 8-bit codes, and for 1-bit codes in
 * LANES tiles with lookup tables (tiles_body with np = 2), picked by w->bits;
 * isa.c offers it for nothing else. */
ALWAYS_INLINE void pair_bits(const ulb_weight *w, const int64_t *ps, const ulb_acts *a, float *const *fs,
                             const int bits, const int lanes) {
    if (a->prefetch_dist)
        tiles_body(w, ps, 2, ULB_PANEL_TILES, 0, ULB_PANEL_TILES, a, 0, fs, NULL, 1, bits, 1, lanes);
    else
        tiles_body(w, ps, 2, ULB_PANEL_TILES, 0, ULB_PANEL_TILES, a, 0, fs, NULL, 1, bits, 0, lanes);
}

void ulb_panel_pair_avx2(const ulb_weight *w, int64_t p, int64_t q, const ulb_acts *a, float *facc_p,
                         float *facc_q) {
    const int64_t ps[ULB_PANEL_PAIR] = {p, q};
    float *const fs[ULB_PANEL_PAIR] = {facc_p, facc_q};
    switch (w->bits) {
    case 1:
        if (w->tiles == ULB_TILES_LANES)
            pair_bits(w, ps, a, fs, 1, 1);
        else
            pair_bits(w, ps, a, fs, 1, 0);
        return;
    case 2: pair_bits(w, ps, a, fs, 2, 0); return;
    case 4: pair_bits(w, ps, a, fs, 4, 0); return;
    default: pair_bits(w, ps, a, fs, 8, 0); return;
    }
}
#endif

ULB_PANEL_BY_WIDTH(ULB_PANEL_AVX2_FN)
