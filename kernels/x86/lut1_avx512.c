/* One-token 1-bit GEMV by table lookup (AVX-512 VBMI + VNNI), after T-MAC:
 * vpermb looks up the partial dot product of 4 weights at once, so one
 * vpdpbusd sums 16 weights per row instead of 4. On Zen 4 this runs 1-bit
 * codes 1.2-1.3x faster in cache than masking fields for vpdpbusd
 * (benchmarks/c/kernel_hot.c) and stays exact: every table entry fits a byte.
 * From DRAM the two kernels trade places with the machine's state (ulb.h);
 * linear.c uses it for one token on one thread unless disabled.
 *
 * Tables, per token and k-step ks (32 columns), ULB_LUT1_STEP_BYTES bytes:
 * four 64-byte tables [L lo, H lo, L hi, H hi], entry e = 16*b + n:
 *   L lo[e] = sum_{i<4} bit_i(n) * (x[32ks + 4i + b] & 15)            in [0, 60]
 *   H lo[e] = sum_{i<4} bit_i(n) * (x[32ks + 4i + b] >> 4) + 32       in [0, 60]
 * and "hi" the same over columns 16 + 4i + b. Since x = 16*(x >> 4) + (x & 15),
 * L + 16*(H - 32) is the exact dot of nibble n with those 4 activations.
 * In a tile (layout.h), byte 4l+b holds in its low nibble the codes of row l at
 * columns 4i+b (i<4) and in its high nibble those at 16+4i+b, so the index
 * (nibble | b << 4) picks the right table slot and the vpdpbusd of a dword
 * (b = 0..3, one row) sums all 16 columns of a nibble half. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")
#include <immintrin.h>

#include "../src/internal.h"

/* Entry e = 16b + n of a table: gather x[4i + b] (+16 for hi) for every n. */
static __m512i gather_index(int i, int hi) {
    uint8_t idx[64];
    for (int e = 0; e < 64; e++) idx[e] = (uint8_t)(4 * i + e / 16 + 16 * hi);
    return _mm512_loadu_si512(idx);
}

/* Entries whose nibble n has bit i set. */
static __mmask64 bit_mask(int i) {
    __mmask64 m = 0;
    for (int e = 0; e < 64; e++)
        if ((e % 16) >> i & 1) m |= (__mmask64)1 << e;
    return m;
}

void ulb_lut1_build_avx512(const int8_t *xq, int64_t ksteps, uint8_t *lut) {
    __m512i gi[2][4];
    __mmask64 bm[4];
    uint8_t h_bias[64];
    for (int i = 0; i < 4; i++) {
        gi[0][i] = gather_index(i, 0);
        gi[1][i] = gather_index(i, 1);
        bm[i] = bit_mask(i);
    }
    /* The H tables are built from x >> 4 biased to x_h + 8 >= 0, so remove
     * 8 per set bit and add the +32 that keeps entries unsigned. */
    for (int e = 0; e < 64; e++) h_bias[e] = (uint8_t)(32 - 8 * __builtin_popcount(e % 16));
    const __m512i hb = _mm512_loadu_si512(h_bias);
    const __m512i m0f = _mm512_set1_epi8(0x0F);
    for (int64_t ks = 0; ks < ksteps; ks++) {
        const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xq + 32 * ks)));
        const __m512i xl = _mm512_and_si512(x, m0f);
        const __m512i xh8 = _mm512_and_si512(_mm512_srli_epi16(_mm512_xor_si512(x, _mm512_set1_epi8((char)0x80)), 4), m0f);
        for (int hi = 0; hi < 2; hi++) {
            __m512i tl = _mm512_maskz_permutexvar_epi8(bm[0], gi[hi][0], xl);
            __m512i th = _mm512_maskz_permutexvar_epi8(bm[0], gi[hi][0], xh8);
            for (int i = 1; i < 4; i++) {
                tl = _mm512_mask_add_epi8(tl, bm[i], tl, _mm512_permutexvar_epi8(gi[hi][i], xl));
                th = _mm512_mask_add_epi8(th, bm[i], th, _mm512_permutexvar_epi8(gi[hi][i], xh8));
            }
            _mm512_storeu_si512(lut + ks * ULB_LUT1_STEP_BYTES + 128 * hi, tl);
            _mm512_storeu_si512(lut + ks * ULB_LUT1_STEP_BYTES + 128 * hi + 64, _mm512_add_epi8(th, hb));
        }
    }
}

/* s[t] += sum over k-steps [ks0, ks1) of (L + 16 H) lookups, rows of tile t. */
ALWAYS_INLINE void lut1_loop(const uint8_t *codes, int64_t ks0, int64_t ks1, const uint8_t *lut,
                             int64_t pf_dist, const uint8_t *pf_end, __m512i s[ULB_PANEL_TILES], const int nt) {
    const __m512i m0f = _mm512_set1_epi8(0x0F), slot = _mm512_set1_epi32(0x30201000);
    const __m512i ones = _mm512_set1_epi8(1), sixteens = _mm512_set1_epi8(16);
    for (int64_t ks = ks0; ks < ks1; ks++) {
        const uint8_t *tab = lut + ks * ULB_LUT1_STEP_BYTES;
        const __m512i l_lo = _mm512_loadu_si512(tab), h_lo = _mm512_loadu_si512(tab + 64);
        const __m512i l_hi = _mm512_loadu_si512(tab + 128), h_hi = _mm512_loadu_si512(tab + 192);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            const uint8_t *tile = codes + ((ks - ks0) * nt + t) * ULB_TILE_BYTES;
            ulb_prefetch_ahead(tile, pf_dist, pf_end);
            const __m512i v = _mm512_loadu_si512(tile);
            /* (nibble | b << 4): vpermb reads the low 6 bits. */
            const __m512i lo = _mm512_ternarylogic_epi32(v, m0f, slot, 0xEA);
            const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), m0f, slot, 0xEA);
            s[t] = _mm512_dpbusd_epi32(s[t], _mm512_permutexvar_epi8(lo, l_lo), ones);
            s[t] = _mm512_dpbusd_epi32(s[t], _mm512_permutexvar_epi8(lo, h_lo), sixteens);
            s[t] = _mm512_dpbusd_epi32(s[t], _mm512_permutexvar_epi8(hi, l_hi), ones);
            s[t] = _mm512_dpbusd_epi32(s[t], _mm512_permutexvar_epi8(hi, h_hi), sixteens);
        }
    }
}

void ulb_lut1_group_avx512(const uint8_t *codes, int64_t ks0, int64_t ks1, int nt, const uint8_t *lut,
                           int64_t pf_dist, const uint8_t *pf_end, int32_t *acc) {
    __m512i s[ULB_PANEL_TILES];
    for (int t = 0; t < ULB_PANEL_TILES; t++) s[t] = _mm512_setzero_si512();
    switch (nt) {
    case 1: lut1_loop(codes, ks0, ks1, lut, pf_dist, pf_end, s, 1); break;
    case 2: lut1_loop(codes, ks0, ks1, lut, pf_dist, pf_end, s, 2); break;
    case 3: lut1_loop(codes, ks0, ks1, lut, pf_dist, pf_end, s, 3); break;
    default: lut1_loop(codes, ks0, ks1, lut, pf_dist, pf_end, s, 4); break;
    }
    /* Every k-step adds 8 H lookups (4 slots, 2 nibbles) of bias 32, times 16. */
    const __m512i bias = _mm512_set1_epi32((int32_t)(8 * 16 * 32 * (ks1 - ks0)));
    for (int t = 0; t < nt; t++) _mm512_storeu_si512(acc + t * ULB_TILE, _mm512_sub_epi32(s[t], bias));
}
