/* One-token 1-bit GEMV by table lookup (AVX-512 VBMI + VNNI), after T-MAC:
 * vpermb looks up the partial dot product of 4 weights at once and two
 * lookups add in a byte, so one vpdpbusd sums 32 weights per row instead of
 * 4. On Zen 4 this runs 1-bit codes faster in cache than masking fields for
 * vpdpbusd (benchmarks/c/kernel_hot.c) and stays exact: every table entry
 * fits a byte.
 * From DRAM it pays on some CPUs only (ulb.h); linear.c uses it for one
 * token on one thread where ulb_lut1_serves says.
 *
 * Tables, per token and k-step ks (32 columns), ULB_LUT1_STEP_BYTES bytes:
 * four 64-byte tables [L lo, H lo, L hi, H hi], entry e = 16*b + n:
 *   L lo[e] = sum_{i<4} bit_i(n) * (x[32ks + 4i + b] & 15)            in [0, 60]
 *   H lo[e] = sum_{i<4} bit_i(n) * (x[32ks + 4i + b] >> 4) + 32       in [0, 60]
 * and "hi" the same over columns 16 + 4i + b. Since x = 16*(x >> 4) + (x & 15),
 * L + 16*(H - 32) is the exact dot of nibble n with those 4 activations.
 * In a tile (layout.h), byte 4l+b holds in its low nibble the codes of row l at
 * columns 4i+b (i<4) and in its high nibble those at 16+4i+b, so the index
 * (nibble | b << 4) picks the right table slot, and the vpdpbusd of a dword
 * (b = 0..3, one row) of the two nibbles' summed L (or H) lookups covers all
 * 32 columns of the k-step. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")
#include <immintrin.h>

#include "../src/internal.h"

/* Tables are built in two steps, each a vpermb gather: first the sums of
 * pairs of columns, Q[32hi + 16h + 4b + p] = sum_{i<2} bit_i(p) x'[16hi + 8h
 * + 4i + b] for the halves h of a nibble and both nibble fields hi, then
 * entry 16b + n of table hi = Q[.. h=0, p = n & 3] + Q[.. h=1, p = n >> 2].
 * That is 12 vpermb a k-step where summing single columns takes 16, which
 * matters as the tables are rebuilt every call. */
static __m512i index_vector(uint8_t (*entry)(int)) {
    uint8_t idx[64];
    for (int e = 0; e < 64; e++) idx[e] = entry(e);
    return _mm512_loadu_si512(idx);
}

/* Q[q], q = 32hi + 16h + 4b + p: the column of pair bit i. */
static uint8_t pair_col0(int q) { return (uint8_t)(16 * (q / 32) + 8 * (q / 16 % 2) + q / 4 % 4); }
static uint8_t pair_col1(int q) { return (uint8_t)(pair_col0(q) + 4); }
/* Table entry e = 16b + n of field hi (only bit 5 of the index, hi, differs
 * between the two fields' index vectors, see build): its two pairs in Q. */
static uint8_t pair_lo(int e) { return (uint8_t)(4 * (e / 16) + e % 4); }
static uint8_t pair_hi(int e) { return (uint8_t)(16 + 4 * (e / 16) + e % 16 / 4); }

static __mmask64 pair_mask(int i) {
    __mmask64 m = 0;
    for (int q = 0; q < 64; q++)
        if ((q % 4) >> i & 1) m |= (__mmask64)1 << q;
    return m;
}

/* Q of x' = src over 32 columns. */
static inline __m512i pair_sums(__m512i src, __m512i c0, __m512i c1, __mmask64 m0, __mmask64 m1) {
    const __m512i q = _mm512_maskz_permutexvar_epi8(m0, c0, src);
    return _mm512_mask_add_epi8(q, m1, q, _mm512_permutexvar_epi8(c1, src));
}

void ulb_lut1_build_avx512(const int8_t *xq, int64_t ksteps, uint8_t *lut) {
    const __m512i c0 = index_vector(pair_col0), c1 = index_vector(pair_col1);
    const __mmask64 m0 = pair_mask(0), m1 = pair_mask(1);
    const __m512i i_lo = index_vector(pair_lo), i_hi = index_vector(pair_hi);
    const __m512i field1 = _mm512_set1_epi8(32);
    /* The H tables are built from x >> 4 biased to x_h + 8 >= 0, so remove
     * 8 per set bit and add the +32 that keeps entries unsigned: 16 - 8
     * popcount(p) on each pair, whose sums then stay in [0, 30]. */
    uint8_t pair_bias[64];
    for (int q = 0; q < 64; q++) pair_bias[q] = (uint8_t)(16 - 8 * __builtin_popcount(q % 4));
    const __m512i hb = _mm512_loadu_si512(pair_bias);
    const __m512i m0f = _mm512_set1_epi8(0x0F);
    for (int64_t ks = 0; ks < ksteps; ks++) {
        const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xq + 32 * ks)));
        const __m512i xl = _mm512_and_si512(x, m0f);
        const __m512i xh8 = _mm512_and_si512(_mm512_srli_epi16(_mm512_xor_si512(x, _mm512_set1_epi8((char)0x80)), 4), m0f);
        const __m512i ql = pair_sums(xl, c0, c1, m0, m1);
        const __m512i qh = _mm512_add_epi8(pair_sums(xh8, c0, c1, m0, m1), hb);
        uint8_t *step = lut + ks * ULB_LUT1_STEP_BYTES;
        for (int hi = 0; hi < 2; hi++) {
            const __m512i a = hi ? _mm512_or_si512(i_lo, field1) : i_lo;
            const __m512i b = hi ? _mm512_or_si512(i_hi, field1) : i_hi;
            _mm512_storeu_si512(step + 128 * hi,
                                _mm512_add_epi8(_mm512_permutexvar_epi8(a, ql), _mm512_permutexvar_epi8(b, ql)));
            _mm512_storeu_si512(step + 128 * hi + 64,
                                _mm512_add_epi8(_mm512_permutexvar_epi8(a, qh), _mm512_permutexvar_epi8(b, qh)));
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
            /* Two entries of [0, 60] still fit a byte. On Zen 4 vpermb and
             * vpdpbusd share a pipe and vpaddb runs on any, so the lookups
             * add before the vpdpbusd instead of after. */
            const __m512i l = _mm512_add_epi8(_mm512_permutexvar_epi8(lo, l_lo), _mm512_permutexvar_epi8(hi, l_hi));
            const __m512i h = _mm512_add_epi8(_mm512_permutexvar_epi8(lo, h_lo), _mm512_permutexvar_epi8(hi, h_hi));
            s[t] = _mm512_dpbusd_epi32(s[t], l, ones);
            s[t] = _mm512_dpbusd_epi32(s[t], h, sixteens);
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
