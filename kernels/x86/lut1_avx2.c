/* One-token 1-bit GEMV by table lookup under AVX2 (vpshufb), after T-MAC,
 * over tiles in the LANES order (layout.h): byte 16b + l of a tile holds, in
 * its low nibble, the codes of row l at columns b, 4 + b, 8 + b, 12 + b and
 * in its high nibble those at 16 + b, ..., 28 + b. A 128-bit lane is byte
 * slot b of all 16 rows, so one 16-entry table per lane and nibble gives
 * each row's partial dot product over 4 columns. Masking fields of VNNI
 * tiles takes 50 vector operations per 64-byte tile and k-step; this takes
 * 26, which shows in cache and from DRAM.
 *
 * Tables, per token and k-step ks (32 columns), ULB_LUT1_STEP_BYTES bytes:
 * eight 32-byte vectors T[h][f][kind] at 32 (4h + 2f + kind), whose lane j
 * serves byte slot b = 2h + j (the 32-byte half h of a tile) and nibble f:
 *   L entry n = sum_{i<4} bit_i(n) * (x[32ks + 16f + 4i + b] & 15)        in [0, 60]
 *   H entry n = sum_{i<4} bit_i(n) * (x[32ks + 16f + 4i + b] >> 4) + 32   in [0, 60]
 * (>> arithmetic), so L + 16 (H - 32) is the exact dot of nibble n with its
 * four activations. The four lookups of a row's byte position (two nibbles,
 * two halves of the tile: 16 columns) add in unsigned bytes, at most 240, so
 * vpmaddubsw of (L, H) pairs by [1, 16] makes L + 16 H in [0, 4080] per row
 * and lane; 16 k-steps sum to at most 65280 in unsigned 16 bits, widened
 * with the bias taken off. Exact, so bit for bit the reference. The loop runs
 * k-step by k-step over the tiles, each k-step's tables loaded once, rather
 * than tile by tile over a chunk, and adds in bytes across the halves (not
 * in 16 bits): both faster in cache. */
#pragma GCC target("avx2")
#include <immintrin.h>
#include <string.h>

#include "../src/internal.h"

#define BIAS (2 * 16 * 4 * 32) /* per row and k-step: 2 lanes x 16 x 4 lookups of H + 32 */

/* The builder with vpshufb: per nibble f, the 16 columns x[16f ..] broadcast
 * to both lanes as x & 15 and as x >> 4; table (h, f) is the sum of four
 * lookups, term i picking column 4i + 2h + j in lane j where bit i of the
 * entry is set (index 0x80 reads 0). */
void ulb_lut1_lanes_build_avx2(const int8_t *xq, int64_t ksteps, uint8_t *lut) {
    __m256i pick[2][4];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 4; i++) {
            uint8_t idx[32];
            for (int e = 0; e < 32; e++) idx[e] = (e % 16) >> i & 1 ? (uint8_t)(4 * i + 2 * h + e / 16) : 0x80;
            memcpy(&pick[h][i], idx, sizeof idx);
        }
    const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m256i bias[2] = {_mm256_setzero_si256(), _mm256_set1_epi8(32)};
    for (int64_t ks = 0; ks < ksteps; ks++) {
        uint8_t *step = lut + ks * ULB_LUT1_STEP_BYTES;
        for (int f = 0; f < 2; f++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(xq + 32 * ks + 16 * f));
            /* x >> 4 arithmetic: the high nibble sign-extended by (h ^ 8) - 8. */
            const __m128i hi = _mm_sub_epi8(_mm_xor_si128(_mm_and_si128(_mm_srli_epi16(v, 4), low), eight), eight);
            const __m256i src[2] = {_mm256_broadcastsi128_si256(_mm_and_si128(v, low)),
                                    _mm256_broadcastsi128_si256(hi)};
            for (int h = 0; h < 2; h++)
                for (int kind = 0; kind < 2; kind++) {
                    const __m256i s = src[kind];
                    const __m256i t = _mm256_add_epi8(
                        _mm256_add_epi8(_mm256_shuffle_epi8(s, pick[h][0]), _mm256_shuffle_epi8(s, pick[h][1])),
                        _mm256_add_epi8(_mm256_shuffle_epi8(s, pick[h][2]),
                                        _mm256_add_epi8(_mm256_shuffle_epi8(s, pick[h][3]), bias[kind])));
                    _mm256_storeu_si256((__m256i *)(step + 32 * (4 * h + 2 * f + kind)), t);
                }
        }
    }
}

/* acc[q][16t + r] += row r of tile t's dot over k-steps [ks0, ks1) of the
 * group whose codes start at codes[q], for np panels (1, or 2 read in
 * lockstep) of nt tiles: k-step by k-step over the tiles of each panel in
 * turn, each k-step's tables loaded once. Unpacking (L, H) bytes pairs rows
 * 0-7 (low) and 8-15 (high) of each lane: per tile, two 16-bit sums whose
 * lanes (byte slots 0 + 2 and 1 + 3) add when widened. */
#define CHUNK 16 /* k-steps summed in 16 bits */
ALWAYS_INLINE void lanes_loop(const uint8_t *const *codes, const int np, int64_t ks0, int64_t ks1, const int nt,
                              const uint8_t *lut, int64_t pf_dist, const uint8_t *pf_end, int32_t *const *acc) {
    const __m256i low = _mm256_set1_epi8(0x0F), one_sixteen = _mm256_set1_epi16(0x1001);
    for (int64_t c0 = ks0; c0 < ks1; c0 += CHUNK) {
        const int64_t c1 = c0 + CHUNK < ks1 ? c0 + CHUNK : ks1;
        __m256i rows[ULB_PANEL_PAIR][ULB_PANEL_TILES][2];
#pragma GCC unroll 2
        for (int q = 0; q < np; q++)
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) rows[q][t][0] = rows[q][t][1] = _mm256_setzero_si256();
        for (int64_t ks = c0; ks < c1; ks++) {
            const __m256i *tab = (const __m256i *)(lut + ks * ULB_LUT1_STEP_BYTES);
#pragma GCC unroll 2
            for (int q = 0; q < np; q++)
#pragma GCC unroll 4
                for (int t = 0; t < nt; t++) {
                    const uint8_t *tile = codes[q] + ((ks - ks0) * nt + t) * ULB_TILE_BYTES;
                    ulb_prefetch_ahead(tile, pf_dist, pf_end);
                    const __m256i v0 = _mm256_loadu_si256((const __m256i *)tile);
                    const __m256i v1 = _mm256_loadu_si256((const __m256i *)(tile + 32));
                    const __m256i a0 = _mm256_and_si256(v0, low), a1 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
                    const __m256i b0 = _mm256_and_si256(v1, low), b1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
                    const __m256i l = _mm256_add_epi8(
                        _mm256_add_epi8(_mm256_shuffle_epi8(_mm256_loadu_si256(tab), a0),
                                        _mm256_shuffle_epi8(_mm256_loadu_si256(tab + 2), a1)),
                        _mm256_add_epi8(_mm256_shuffle_epi8(_mm256_loadu_si256(tab + 4), b0),
                                        _mm256_shuffle_epi8(_mm256_loadu_si256(tab + 6), b1)));
                    const __m256i hh = _mm256_add_epi8(
                        _mm256_add_epi8(_mm256_shuffle_epi8(_mm256_loadu_si256(tab + 1), a0),
                                        _mm256_shuffle_epi8(_mm256_loadu_si256(tab + 3), a1)),
                        _mm256_add_epi8(_mm256_shuffle_epi8(_mm256_loadu_si256(tab + 5), b0),
                                        _mm256_shuffle_epi8(_mm256_loadu_si256(tab + 7), b1)));
                    rows[q][t][0] = _mm256_add_epi16(rows[q][t][0],
                                                     _mm256_maddubs_epi16(_mm256_unpacklo_epi8(l, hh), one_sixteen));
                    rows[q][t][1] = _mm256_add_epi16(rows[q][t][1],
                                                     _mm256_maddubs_epi16(_mm256_unpackhi_epi8(l, hh), one_sixteen));
                }
        }
        const __m256i bias = _mm256_set1_epi32((int32_t)(BIAS * (c1 - c0)));
#pragma GCC unroll 2
        for (int q = 0; q < np; q++)
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    __m256i *o = (__m256i *)(acc[q] + ULB_TILE * t + 8 * h);
                    const __m256i r = rows[q][t][h];
                    const __m256i w = _mm256_add_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(r)),
                                                       _mm256_cvtepu16_epi32(_mm256_extracti128_si256(r, 1)));
                    _mm256_storeu_si256(o, _mm256_add_epi32(_mm256_loadu_si256(o), _mm256_sub_epi32(w, bias)));
                }
    }
}

void ulb_lut1_lanes_group_avx2(const uint8_t *codes, int64_t ks0, int64_t ks1, int nt, const uint8_t *lut,
                               int64_t pf_dist, const uint8_t *pf_end, int32_t *acc) {
    memset(acc, 0, ULB_PANEL_ROWS * sizeof *acc);
    switch (nt) {
    case 1: lanes_loop(&codes, 1, ks0, ks1, 1, lut, pf_dist, pf_end, &acc); return;
    case 2: lanes_loop(&codes, 1, ks0, ks1, 2, lut, pf_dist, pf_end, &acc); return;
    case 3: lanes_loop(&codes, 1, ks0, ks1, 3, lut, pf_dist, pf_end, &acc); return;
    default: lanes_loop(&codes, 1, ks0, ks1, 4, lut, pf_dist, pf_end, &acc); return;
    }
}

void ulb_lut1_lanes_pair_avx2(const uint8_t *codes_p, const uint8_t *codes_q, int64_t ks0, int64_t ks1,
                              const uint8_t *lut, int64_t pf_dist, const uint8_t *pf_end, int32_t *acc_p,
                              int32_t *acc_q) {
    const uint8_t *const codes[ULB_PANEL_PAIR] = {codes_p, codes_q};
    int32_t *const acc[ULB_PANEL_PAIR] = {acc_p, acc_q};
    memset(acc_p, 0, ULB_PANEL_ROWS * sizeof *acc_p);
    memset(acc_q, 0, ULB_PANEL_ROWS * sizeof *acc_q);
    lanes_loop(codes, 2, ks0, ks1, ULB_PANEL_TILES, lut, pf_dist, pf_end, acc);
}
