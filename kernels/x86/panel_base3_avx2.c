/* AVX2 microkernel of base-3 codes (ternary_base3; src/base3.h), for AVX2
 * and AVX-VNNI CPUs and AVX-512 ones without VBMI: up to 64 rows x 4 tokens
 * per call. Each half tile (32 bytes, 8 rows) is decoded with base3.h's
 * multiply in 16-bit lanes, q kept in the high byte of each word (even bytes
 * shifted up, odd ones masked), so that vpmulhuw by 3 gives the digit and
 * vpmullw by 3 the next q; then 2 - c where the sign bit is set, and
 * vpmaddubsw with the k-quad's activations, summed in int16 over the five
 * digits (|sum| <= 5 * 2 * 2 * 128) before one vpmaddwd. Must match
 * ref/panel_ref.c bit for bit. */
#pragma GCC target("avx2")
#include <immintrin.h>

#include "../src/internal.h"

/* sum over the five digits of half tile v of vpmaddubsw(codes, activations of
 * the digit's k-quad at x + 4j), for nb tokens (x[n] at the tile's column 0). */
ALWAYS_INLINE void half_sums(__m256i v, const int8_t *const *x, int64_t col, __m256i s16[ULB_NB_MAX], const int nb) {
    const __m256i three = _mm256_set1_epi16(3), two = _mm256_set1_epi8(2);
    const __m256i q = _mm256_or_si256(v, _mm256_set1_epi8((char)0x80));
    __m256i qe = _mm256_slli_epi16(q, 8), qo = _mm256_and_si256(q, _mm256_set1_epi16((short)0xff00));
#pragma GCC unroll 4
    for (int n = 0; n < nb; n++) s16[n] = _mm256_setzero_si256();
#pragma GCC unroll 5
    for (int j = 0; j < ULB_BASE3_DIGITS; j++) {
        const __m256i de = _mm256_mulhi_epu16(qe, three), dd = _mm256_mulhi_epu16(qo, three);
        qe = _mm256_mullo_epi16(qe, three);
        qo = _mm256_mullo_epi16(qo, three);
        const __m256i d = _mm256_or_si256(de, _mm256_slli_epi16(dd, 8));
        const __m256i c = _mm256_blendv_epi8(d, _mm256_sub_epi8(two, d), v);
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++) {
            int32_t x4;
            __builtin_memcpy(&x4, x[n] + col + 4 * j, sizeof x4);
            s16[n] = _mm256_add_epi16(s16[n], _mm256_maddubs_epi16(c, _mm256_set1_epi32(x4)));
        }
    }
}

ALWAYS_INLINE void panel_body(const ulb_weight *w, int64_t tile0, const ulb_acts *a, int64_t n0, float *facc,
                              int32_t *dots, const int nb, const int nt, const int prefetch) {
    const int64_t pf_dist = prefetch ? a->prefetch_dist : 0, kt = ULB_TILE_K(ULB_BASE3_BITS);
    const int8_t *x[ULB_NB_MAX];
    for (int n = 0; n < nb; n++) x[n] = a->xq + (n0 + n) * a->ldq;
    const __m256i ones = _mm256_set1_epi16(1), va = _mm256_set1_epi32(w->level_a);
    __m256 f[ULB_NB_MAX][ULB_PANEL_TILES][2];
#pragma GCC unroll 4
    for (int n = 0; n < nb; n++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) f[n][t][0] = f[n][t][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w->n_groups; g++) {
        const int64_t ks0 = g * w->gsteps, ks1 = ks0 + ulb_group_steps(w, g);
        const uint8_t *group = ulb_group_base(w, tile0 / ULB_PANEL_TILES, nt, g);
        const uint8_t *codes = group + nt * ULB_TILE_SCALE_BYTES;
        const float *scales = (const float *)group;
        __m256i acc[ULB_NB_MAX][ULB_PANEL_TILES][2];
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++)
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) acc[n][t][0] = acc[n][t][1] = _mm256_setzero_si256();
        for (int64_t ks = ks0; ks < ks1; ks++) {
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) {
                const uint8_t *tile = codes + ((ks - ks0) * nt + t) * ULB_TILE_BYTES;
                ulb_prefetch_ahead(tile, pf_dist, a->prefetch_end);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    __m256i s16[ULB_NB_MAX];
                    half_sums(_mm256_loadu_si256((const __m256i *)(tile + 32 * h)), x, ks * kt, s16, nb);
#pragma GCC unroll 4
                    for (int n = 0; n < nb; n++)
                        acc[n][t][h] = _mm256_add_epi32(acc[n][t][h], _mm256_madd_epi16(s16[n], ones));
                }
            }
        }
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++) {
            const __m256i vb = _mm256_set1_epi32(w->level_b * a->xsum[(n0 + n) * w->n_groups + g]);
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256i dot = _mm256_add_epi32(_mm256_mullo_epi32(acc[n][t][h], va), vb);
                    const __m256 s = _mm256_loadu_ps(scales + t * ULB_TILE + 8 * h);
                    f[n][t][h] = _mm256_add_ps(f[n][t][h], _mm256_mul_ps(s, _mm256_cvtepi32_ps(dot)));
                    if (dots)
                        _mm256_storeu_si256((__m256i *)(dots + (n * w->n_groups + g) * ULB_PANEL_ROWS + t * ULB_TILE +
                                                        8 * h),
                                            dot);
                }
        }
    }
#pragma GCC unroll 4
    for (int n = 0; n < nb; n++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(facc + n * ULB_PANEL_ROWS + t * ULB_TILE + 8 * h, f[n][t][h]);
}

#define ULB_CASE(PF, NB, NT)                                                                       \
    case (PF) * 64 + (NB) * 8 + (NT): panel_body(w, tile0, a, n0, facc, dots, NB, NT, PF); return;
#define ULB_CASES_NB(PF, NB) ULB_CASE(PF, NB, 1) ULB_CASE(PF, NB, 2) ULB_CASE(PF, NB, 3) ULB_CASE(PF, NB, 4)
#define ULB_CASES_PF(PF) ULB_CASES_NB(PF, 1) ULB_CASES_NB(PF, 2) ULB_CASES_NB(PF, 3) ULB_CASES_NB(PF, 4)

void ulb_panel_base3_avx2(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb,
                          float *facc, int32_t *dots) {
    switch ((a->prefetch_dist != 0) * 64 + nb * 8 + ntiles) { ULB_CASES_PF(0) ULB_CASES_PF(1) }
}
