/* Pieces the AVX-512 VNNI panel kernels share (panel_avx512.c for bit
 * fields, panel_base3_avx512.c for base 3); included after each file's
 * target pragma. */
#ifndef ULB_VNNI512_H
#define ULB_VNNI512_H

#include <immintrin.h>

#include "../src/internal.h"

/* acc += u (u8) . broadcast of the 4 int8 at p, with the broadcast folded into
 * the instruction: GCC otherwise hoists the broadcasts into registers, and
 * the one-token loop (16 accumulators) then spills. */
ALWAYS_INLINE __m512i dpbusd_bcast(__m512i acc, __m512i u, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}

/* The sum of four partial sums of which slot s holds 2^(bits * s) times its
 * products: each shifted back exactly (a multiple of its scale). */
ALWAYS_INLINE __m512i slots_sum(__m512i s0, __m512i s1, __m512i s2, __m512i s3, const int bits) {
    return _mm512_add_epi32(_mm512_add_epi32(s0, _mm512_srai_epi32(s1, bits)),
                            _mm512_add_epi32(_mm512_srai_epi32(s2, 2 * bits), _mm512_srai_epi32(s3, 3 * bits)));
}

/* Group g's sums acc (tokens n0.. of nb, nt tiles) into the running results
 * f, under the contract of internal.h: dot = level_a * acc + level_b * xsum,
 * f += scale * dot in fp32, and dots where asked; the group's scales start
 * at `scales`. */
ALWAYS_INLINE void group_out(const ulb_weight *w, const ulb_acts *a, int64_t n0, int64_t g, const float *scales,
                             __m512i acc[ULB_NB_MAX][ULB_PANEL_TILES], __m512 f[ULB_NB_MAX][ULB_PANEL_TILES],
                             int32_t *dots, const int nb, const int nt) {
    const __m512i va = _mm512_set1_epi32(w->level_a);
#pragma GCC unroll 4
    for (int j = 0; j < nb; j++) {
        const __m512i vb = _mm512_set1_epi32(w->level_b * a->xsum[(n0 + j) * w->n_groups + g]);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(acc[j][t], va), vb);
            const __m512 s = _mm512_loadu_ps(scales + t * ULB_TILE);
            f[j][t] = _mm512_add_ps(f[j][t], _mm512_mul_ps(s, _mm512_cvtepi32_ps(dot)));
            if (dots) _mm512_storeu_si512(dots + (j * w->n_groups + g) * ULB_PANEL_ROWS + t * ULB_TILE, dot);
        }
    }
}

#endif
