/* AVX-512 microkernel of base-3 codes (ternary_base3; src/base3.h): up to 64
 * rows x 4 tokens per call. A tile's digits are looked up, 64 bytes at a
 * time, by vpermi2b (VBMI) on each byte's low 7 bits, then 2 - c where the
 * sign bit is set (one masked subtract); digit j is the VNNI4 operand of
 * k-quad j (layout.h), as field j of a 2-bit tile is. Must match
 * ref/panel_ref.c bit for bit. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")
#include "vnni512.h"

/* Two lookups decode a tile: A, the codes of digits 0..3 as the 2-bit fields
 * of one byte (c0 + 4 c1 + 16 c2 + 64 c3: a 2-bit VNNI tile of k-quads 0..3),
 * and B, digit 4; each a 128-entry table on the byte's low 7 bits (base3.h's
 * rule, sign bit clear), filled when the library loads. The sign bit then
 * turns every field c into 2 - c at once: A' = 170 - A, B' = 2 - B (no field
 * borrows). Fewer vpermi2b than a lookup per digit, which is what bounds the
 * loop, at the price of masking A's fields in place, as the 2-bit kernel does
 * (slot s holds 4^s times its products, shifted back once per group). */
static uint8_t TABLE_A[128] __attribute__((aligned(64))), TABLE_B[128] __attribute__((aligned(64)));

__attribute__((constructor)) static void fill_tables(void) {
    for (int i = 0; i < 128; i++) {
        unsigned a = 0;
        for (int j = 0; j < 4; j++) a |= ulb_base3_code((uint8_t)i, j) << (2 * j);
        TABLE_A[i] = (uint8_t)a;
        TABLE_B[i] = (uint8_t)ulb_base3_code((uint8_t)i, 4);
    }
}

typedef struct {
    __m512i a_lo, a_hi, b_lo, b_hi;
} digit_tables;

ALWAYS_INLINE digit_tables load_tables(void) {
    return (digit_tables){_mm512_load_si512(TABLE_A), _mm512_load_si512(TABLE_A + 64), _mm512_load_si512(TABLE_B),
                          _mm512_load_si512(TABLE_B + 64)};
}

/* slots[s] += field s of A . x[4s..4s+3] (4^s times the codes), and digit 4
 * (B) . x[16..19] into slot 0, for the tile at `tile` and nb tokens. */
ALWAYS_INLINE void tile_sums(const digit_tables *d, const uint8_t *tile, const int8_t *const *xk,
                             __m512i slots[4][ULB_NB_MAX], const int nb) {
    const __m512i v = _mm512_loadu_si512(tile);
    const __mmask64 neg = _mm512_movepi8_mask(v);
    __m512i a = _mm512_permutex2var_epi8(d->a_lo, v, d->a_hi);
    __m512i b = _mm512_permutex2var_epi8(d->b_lo, v, d->b_hi);
    a = _mm512_mask_sub_epi8(a, neg, _mm512_set1_epi8((char)170), a);
    b = _mm512_mask_sub_epi8(b, neg, _mm512_set1_epi8(2), b);
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
        const __m512i f = _mm512_and_si512(a, _mm512_set1_epi8((char)(3 << (2 * s))));
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++) slots[s][n] = dpbusd_bcast(slots[s][n], f, xk[n] + 4 * s);
    }
#pragma GCC unroll 4
    for (int n = 0; n < nb; n++) slots[0][n] = dpbusd_bcast(slots[0][n], b, xk[n] + 16);
}

/* One token: the group's k-steps in order, every tile of a step, 4 slots a
 * tile (16 independent chains for a full panel). */
ALWAYS_INLINE void one_token_group(const digit_tables *d, const uint8_t *codes, int64_t ks0, int64_t ks1,
                                   const int8_t *x, int64_t pf_dist, const uint8_t *pf_end,
                                   __m512i acc[ULB_PANEL_TILES], const int nt) {
    const int kt = ULB_TILE_K(ULB_BASE3_BITS);
    __m512i slots[ULB_PANEL_TILES][4][ULB_NB_MAX];
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) slots[t][s][0] = _mm512_setzero_si512();
    for (int64_t ks = ks0; ks < ks1; ks++) {
        const int8_t *xk[1] = {x + ks * kt};
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            const uint8_t *tile = codes + ((ks - ks0) * nt + t) * ULB_TILE_BYTES;
            ulb_prefetch_ahead(tile, pf_dist, pf_end);
            tile_sums(d, tile, xk, slots[t], 1);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) acc[t] = slots_sum(slots[t][0][0], slots[t][1][0], slots[t][2][0], slots[t][3][0], 2);
}

/* Several tokens: a tile at a time through the group (4 slots x nb sums;
 * every tile's would spill), the tile's k-steps nt tiles apart. That reads
 * a line in every nt, which streams badly from DRAM, so the call on a
 * panel's first tokens prefetches the next panel (`ahead`: a panel's bytes)
 * in order, a line for each tile it reads, as panel_avx512.c's
 * tokens_group_slots does. */
ALWAYS_INLINE void tokens_group(const digit_tables *d, const uint8_t *codes, int64_t ks0, int64_t ks1,
                                const int8_t *const *x, int64_t ahead, const uint8_t *pf_end,
                                __m512i acc[ULB_NB_MAX][ULB_PANEL_TILES], const int nb, const int nt) {
    const int kt = ULB_TILE_K(ULB_BASE3_BITS);
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) {
        __m512i slots[4][ULB_NB_MAX];
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++)
#pragma GCC unroll 4
            for (int n = 0; n < nb; n++) slots[s][n] = _mm512_setzero_si512();
        for (int64_t ks = ks0; ks < ks1; ks++) {
            const uint8_t *tile = codes + ((ks - ks0) * nt + t) * ULB_TILE_BYTES;
            ulb_prefetch_ahead(codes + (t * (ks1 - ks0) + ks - ks0) * ULB_TILE_BYTES, ahead, pf_end);
            const int8_t *xk[ULB_NB_MAX];
#pragma GCC unroll 4
            for (int n = 0; n < nb; n++) xk[n] = x[n] + ks * kt;
            tile_sums(d, tile, xk, slots, nb);
        }
#pragma GCC unroll 4
        for (int n = 0; n < nb; n++) acc[n][t] = slots_sum(slots[0][n], slots[1][n], slots[2][n], slots[3][n], 2);
    }
}

/* prefetch (a constant): whether to prefetch at all, as in panel_avx512.c. */
ALWAYS_INLINE void panel_body(const ulb_weight *w, int64_t tile0, const ulb_acts *a, int64_t n0, float *facc,
                              int32_t *dots, const int nb, const int nt, const int prefetch) {
    const int64_t pf_dist = prefetch ? a->prefetch_dist : 0;
    const digit_tables d = load_tables();
    const int8_t *x[ULB_NB_MAX];
    for (int n = 0; n < nb; n++) x[n] = a->xq + (n0 + n) * a->ldq;
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
        if (nb == 1)
            one_token_group(&d, codes, ks0, ks1, x[0], pf_dist, a->prefetch_end, acc[0], nt);
        else
            tokens_group(&d, codes, ks0, ks1, x, pf_dist && n0 == 0 ? ulb_panel_offset(w->ksteps, w->n_groups, 1) : 0,
                         a->prefetch_end, acc, nb, nt);
        group_out(w, a, n0, g, scales, acc, f, dots, nb, nt);
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
