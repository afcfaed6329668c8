/* AVX-512 microkernel of base-3 codes (ternary_base3; src/base3.h): up to 64
 * rows x 4 tokens per call. A tile's five digits are looked up, 64 bytes at a
 * time, in five 128-entry tables by vpermi2b (VBMI) on each byte's low 7
 * bits, then 2 - c where the sign bit is set (one masked subtract); digit j
 * is then the VNNI4 operand of k-quad j (layout.h), as field j of a 2-bit
 * tile is. Must match ref/panel_ref.c bit for bit. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")
#include <immintrin.h>

#include "../src/internal.h"

/* acc += u (u8) . broadcast of the 4 int8 at p, the broadcast folded into the
 * instruction (as in panel_avx512.c: hoisted broadcasts spill). */
ALWAYS_INLINE __m512i dpbusd_bcast(__m512i acc, __m512i u, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}

/* Digit j of every byte of a tile, for the 128 values of the low 7 bits
 * (base3.h's rule, sign bit clear), filled when the library loads; a call
 * holds them in two registers of 64 entries each. */
static uint8_t TABLES[ULB_BASE3_DIGITS][128] __attribute__((aligned(64)));

__attribute__((constructor)) static void fill_tables(void) {
    for (int j = 0; j < ULB_BASE3_DIGITS; j++)
        for (int i = 0; i < 128; i++) TABLES[j][i] = (uint8_t)ulb_base3_code((uint8_t)i, j);
}

typedef struct {
    __m512i lo[ULB_BASE3_DIGITS], hi[ULB_BASE3_DIGITS];
} digit_tables;

ALWAYS_INLINE digit_tables load_tables(void) {
    const uint8_t(*t)[128] = TABLES;
    digit_tables d;
    for (int j = 0; j < ULB_BASE3_DIGITS; j++) {
        d.lo[j] = _mm512_load_si512(t[j]);
        d.hi[j] = _mm512_load_si512(t[j] + 64);
    }
    return d;
}

/* Codes of digit j of tile v whose sign bits are `neg`. */
ALWAYS_INLINE __m512i digit(const digit_tables *d, __m512i v, __mmask64 neg, int j) {
    const __m512i c = _mm512_permutex2var_epi8(d->lo[j], v, d->hi[j]);
    return _mm512_mask_sub_epi8(c, neg, _mm512_set1_epi8(2), c);
}

/* sum q x of group [ks0, ks1) of nt tiles for nb tokens into acc, the tiles
 * of a k-step at codes + (ks - ks0) * step_bytes. One token keeps even and
 * odd digits in two sums, so that each tile's chain of vpdpbusd is shorter;
 * several tokens' sums are independent chains already. */
ALWAYS_INLINE void group_sums(const digit_tables *d, const uint8_t *codes, int64_t step_bytes, int64_t ks0,
                              int64_t ks1, const int8_t *const *x, int64_t pf_dist, const uint8_t *pf_end,
                              __m512i acc[ULB_NB_MAX][ULB_PANEL_TILES], const int nb, const int nt) {
    const int kt = ULB_TILE_K(ULB_BASE3_BITS), sums = nb == 1 ? 2 : 1;
    __m512i part[2][ULB_NB_MAX][ULB_PANEL_TILES];
#pragma GCC unroll 2
    for (int s = 0; s < sums; s++)
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++)
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) part[s][n][t] = _mm512_setzero_si512();
    for (int64_t ks = ks0; ks < ks1; ks++) {
        const int8_t *xk[ULB_NB_MAX];
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++) xk[n] = x[n] + ks * kt;
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            const uint8_t *tile = codes + (ks - ks0) * step_bytes + t * ULB_TILE_BYTES;
            ulb_prefetch_ahead(tile, pf_dist, pf_end);
            const __m512i v = _mm512_loadu_si512(tile);
            const __mmask64 neg = _mm512_movepi8_mask(v);
#pragma GCC unroll 5
            for (int j = 0; j < ULB_BASE3_DIGITS; j++) {
                const __m512i c = digit(d, v, neg, j);
#pragma GCC unroll 4
                for (int n = 0; n < nb; n++)
                    part[j % sums][n][t] = dpbusd_bcast(part[j % sums][n][t], c, xk[n] + 4 * j);
            }
        }
    }
#pragma GCC unroll 4
    for (int n = 0; n < nb; n++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
            acc[n][t] = sums == 2 ? _mm512_add_epi32(part[0][n][t], part[1][n][t]) : part[0][n][t];
}

/* prefetch (a constant): whether to prefetch at all, as in panel_avx512.c. */
ALWAYS_INLINE void panel_body(const ulb_weight *w, int64_t tile0, const ulb_acts *a, int64_t n0, float *facc,
                              int32_t *dots, const int nb, const int nt, const int prefetch) {
    const int64_t pf_dist = prefetch ? a->prefetch_dist : 0;
    const digit_tables d = load_tables();
    const int8_t *x[ULB_NB_MAX];
    for (int n = 0; n < nb; n++) x[n] = a->xq + (n0 + n) * a->ldq;
    const __m512i va = _mm512_set1_epi32(w->level_a);
    __m512 f[ULB_NB_MAX][ULB_PANEL_TILES];
#pragma GCC unroll 4
    for (int n = 0; n < nb; n++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) f[n][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < w->n_groups; g++) {
        const int64_t ks0 = g * w->gsteps, ks1 = ks0 + ulb_group_steps(w, g);
        const uint8_t *group = ulb_group_base(w, tile0 / ULB_PANEL_TILES, nt, g);
        const float *scales = (const float *)group;
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) ulb_prefetch_ahead(group + t * ULB_TILE_SCALE_BYTES, pf_dist, a->prefetch_end);
        __m512i acc[ULB_NB_MAX][ULB_PANEL_TILES];
        const uint8_t *codes = group + nt * ULB_TILE_SCALE_BYTES;
        const int64_t step = nt * ULB_TILE_BYTES;
        if (nb <= 2) {
            group_sums(&d, codes, step, ks0, ks1, x, pf_dist, a->prefetch_end, acc, nb, nt);
        } else { /* a tile at a time: nb x 4 sums beside the 10 tables would spill */
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) {
                __m512i one[ULB_NB_MAX][ULB_PANEL_TILES];
                group_sums(&d, codes + t * ULB_TILE_BYTES, step, ks0, ks1, x, pf_dist, a->prefetch_end, one, nb, 1);
#pragma GCC unroll 4
                for (int n = 0; n < nb; n++) acc[n][t] = one[n][0];
            }
        }
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++) {
            const __m512i vb = _mm512_set1_epi32(w->level_b * a->xsum[(n0 + n) * w->n_groups + g]);
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) {
                const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(acc[n][t], va), vb);
                f[n][t] = _mm512_add_ps(f[n][t], _mm512_mul_ps(_mm512_loadu_ps(scales + t * ULB_TILE),
                                                               _mm512_cvtepi32_ps(dot)));
                if (dots) _mm512_storeu_si512(dots + (n * w->n_groups + g) * ULB_PANEL_ROWS + t * ULB_TILE, dot);
            }
        }
    }
#pragma GCC unroll 4
    for (int n = 0; n < nb; n++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) _mm512_storeu_ps(facc + n * ULB_PANEL_ROWS + t * ULB_TILE, f[n][t]);
}

#define ULB_CASE(PF, NB, NT)                                                                       \
    case (PF) * 64 + (NB) * 8 + (NT): panel_body(w, tile0, a, n0, facc, dots, NB, NT, PF); return;
#define ULB_CASES_NB(PF, NB) ULB_CASE(PF, NB, 1) ULB_CASE(PF, NB, 2) ULB_CASE(PF, NB, 3) ULB_CASE(PF, NB, 4)
#define ULB_CASES_PF(PF) ULB_CASES_NB(PF, 1) ULB_CASES_NB(PF, 2) ULB_CASES_NB(PF, 3) ULB_CASES_NB(PF, 4)

void ulb_panel_base3_avx512(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb,
                            float *facc, int32_t *dots) {
    switch ((a->prefetch_dist != 0) * 64 + nb * 8 + ntiles) { ULB_CASES_PF(0) ULB_CASES_PF(1) }
}
