/* AVX-512 VNNI microkernels (1-, 2-, 4- and 8-bit codes): up to 64 rows x 4 tokens
 * per call, u8 codes x s8 activations with vpdpbusd. The affine level map is
 * applied once per group (see internal.h), so one instruction serves every
 * format. Must match ref/panel_ref.c bit for bit. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#include "vnni512.h"

/* An 8-byte demand load of the line at p, result unused. One per tile beside
 * the 64-byte load lets the 2-bit one-token loop stream faster from DRAM on
 * Zen 4 on long rows, as it does a plain 64-byte-load read loop. The 1-bit
 * kernels, with their software prefetch, do not gain. The line touched is the next one in the blob, which
 * ends with a line of padding for the last tile's touch. */
ALWAYS_INLINE void touch_line(const uint8_t *p) {
    int64_t unused;
    __asm__ volatile("movq %1, %0" : "=r"(unused) : "m"(*(const int64_t *)p));
}

/* Field j of a tile brought down to 0..(2^bits - 1): the VNNI4 operand of
 * k-quad j. */
ALWAYS_INLINE __m512i field(__m512i v, int j, const int bits) {
    const __m512i mask = _mm512_set1_epi8((char)((1 << bits) - 1));
    return _mm512_and_si512(j ? _mm512_srli_epi16(v, bits * j) : v, mask);
}

/* Field f of a tile v masked in place, in slot f % 4: 2^(bits * slot) times
 * its code. 1-bit fields 4..7 come from hi, the tile shifted down by 4 (for
 * wider codes hi is v, unused). */
ALWAYS_INLINE __m512i slot_field(__m512i v, __m512i hi, int f, const int bits) {
    const __m512i m = _mm512_set1_epi8((char)(((1 << bits) - 1) << (bits * (f % 4))));
    return _mm512_and_si512(f < 4 ? v : hi, m);
}

/* One token. Masking field j in place leaves 2^(bits*j) * q; fields 4..7 of
 * 1-bit tiles are shifted down by 4 first, so four accumulators per tile
 * (one per scale) give 16 independent vpdpbusd chains for a full panel, and
 * each is scaled back exactly (arithmetic shift of a multiple of its scale)
 * once per group. */
ALWAYS_INLINE void one_token_group(const uint8_t *codes, int64_t ks0, int64_t ks1, const int8_t *x,
                                   int64_t pf_dist, const uint8_t *pf_end, __m512i acc[ULB_PANEL_TILES], const int nt,
                                   const int bits) {
    const int fields = 8 / bits, kt = 32 / bits;
    __m512i f4[4][ULB_PANEL_TILES];
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) f4[0][t] = f4[1][t] = f4[2][t] = f4[3][t] = _mm512_setzero_si512();
    for (int64_t ks = ks0; ks < ks1; ks++) {
        const int8_t *xk = x + ks * kt;
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            const uint8_t *tile = codes + ((ks - ks0) * nt + t) * ULB_TILE_BYTES;
            ulb_prefetch_ahead(tile, pf_dist, pf_end);
            const __m512i v = _mm512_loadu_si512(tile);
            if (bits == 2) touch_line(tile + ULB_TILE_BYTES);
            const __m512i hi = bits == 1 ? _mm512_srli_epi16(v, 4) : v;
#pragma GCC unroll 8
            for (int j = 0; j < fields; j++)
                f4[j % 4][t] = dpbusd_bcast(f4[j % 4][t], slot_field(v, hi, j, bits), xk + 4 * j);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) acc[t] = slots_sum(f4[0][t], f4[1][t], f4[2][t], f4[3][t], bits);
}

/* Several tokens where use_slots says no: every tile at a time, each tile's
 * fields shifted down, masked once and used nb times. */
ALWAYS_INLINE void tokens_group(const uint8_t *codes, int64_t ks0, int64_t ks1, const int8_t *const *x,
                                int64_t pf_dist, const uint8_t *pf_end, __m512i acc[ULB_NB_MAX][ULB_PANEL_TILES], const int nb,
                                const int nt, const int bits) {
    const int fields = 8 / bits, kt = 32 / bits;
#pragma GCC unroll 4
    for (int j = 0; j < nb; j++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) acc[j][t] = _mm512_setzero_si512();
    for (int64_t ks = ks0; ks < ks1; ks++) {
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            const uint8_t *tile = codes + ((ks - ks0) * nt + t) * ULB_TILE_BYTES;
            ulb_prefetch_ahead(tile, pf_dist, pf_end);
            const __m512i v = _mm512_loadu_si512(tile);
#pragma GCC unroll 8
            for (int f = 0; f < fields; f++) {
                const __m512i u = field(v, f, bits);
#pragma GCC unroll 4
                for (int j = 0; j < nb; j++)
                    acc[j][t] = dpbusd_bcast(acc[j][t], u, x[j] + ks * kt + 4 * f);
            }
        }
    }
}

/* Several tokens, 1- and 2-bit codes: one tile at a time through the group,
 * with a partial sum per token and slot as in one_token_group, fields masked
 * in place (1-bit fields 4..7 after one shift). A tile then costs 4 (2-bit)
 * or 9 (1-bit) vector operations besides its 4 x nb or 8 x nb vpdpbusd, not
 * 7 or 15, and the 4 x nb sums still form independent chains
 * (benchmarks/c/kernel_hot.c).
 * Reading a panel one tile at a time takes a line in every four, which
 * streams badly from DRAM; so the call on a panel's first tokens prefetches
 * the next panel (`ahead`: a panel's bytes) in order, a line for each tile it
 * reads, and has it in L2 when its turn comes. Cold, against tokens_group
 * (benchmarks/c/ab_builds.sh), this pays for 2-bit calls from 4 tokens on
 * and for 1-bit ones from 2 (use_slots). With 4- and 8-bit codes there are
 * too few fields for 4 slots, and 2 slots did not beat tokens_group. */
static inline int use_slots(int bits, int64_t tokens) { return bits == 1 || (bits == 2 && tokens >= 4); }

ALWAYS_INLINE void tokens_group_slots(const uint8_t *codes, int64_t ks0, int64_t ks1, const int8_t *const *x,
                                      int64_t ahead, const uint8_t *pf_end,
                                      __m512i acc[ULB_NB_MAX][ULB_PANEL_TILES], const int nb, const int nt,
                                      const int bits) {
    const int fields = 8 / bits, kt = 32 / bits;
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) {
        __m512i part[4][ULB_NB_MAX];
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++)
#pragma GCC unroll 4
            for (int j = 0; j < nb; j++) part[s][j] = _mm512_setzero_si512();
        for (int64_t ks = ks0; ks < ks1; ks++) {
            const uint8_t *tile = codes + ((ks - ks0) * nt + t) * ULB_TILE_BYTES;
            ulb_prefetch_ahead(codes + (t * (ks1 - ks0) + ks - ks0) * ULB_TILE_BYTES, ahead, pf_end);
            const __m512i v = _mm512_loadu_si512(tile);
            const __m512i hi = bits == 1 ? _mm512_srli_epi16(v, 4) : v;
#pragma GCC unroll 8
            for (int f = 0; f < fields; f++) {
                const __m512i u = slot_field(v, hi, f, bits);
#pragma GCC unroll 4
                for (int j = 0; j < nb; j++) part[f % 4][j] = dpbusd_bcast(part[f % 4][j], u, x[j] + ks * kt + 4 * f);
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < nb; j++) acc[j][t] = slots_sum(part[0][j], part[1][j], part[2][j], part[3][j], bits);
    }
}

/* prefetch (a constant): whether to prefetch at all. Without it the prefetch
 * code is compiled out: a distance of 0 read at run time, with its test in the
 * tile loop, slowed the 2-bit one-token loop on Zen 4. (The 1-bit
 * lookup kernel, which always prefetches unless told not to, takes the
 * distance as is.) */
ALWAYS_INLINE void panel_body(const ulb_weight *w, int64_t tile0, const ulb_acts *a, int64_t n0,
                              float *facc, int32_t *dots, const int nb, const int nt,
                              const int bits, const int prefetch) {
    const int64_t pf_dist = prefetch ? a->prefetch_dist : 0;
    const int8_t *x[ULB_NB_MAX];
    for (int j = 0; j < nb; j++) x[j] = a->xq + (n0 + j) * a->ldq;
    __m512 f[ULB_NB_MAX][ULB_PANEL_TILES];
#pragma GCC unroll 4
    for (int j = 0; j < nb; j++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) f[j][t] = _mm512_setzero_ps();

    for (int64_t g = 0; g < w->n_groups; g++) {
        const int64_t ks0 = g * w->gsteps;
        const int64_t ks1 = ks0 + ulb_group_steps(w, g);
        const uint8_t *group = ulb_group_base(w, tile0 / ULB_PANEL_TILES, nt, g);
        const float *scales = (const float *)group;
        const uint8_t *codes = group + nt * ULB_TILE_SCALE_BYTES;
        /* As far ahead of the scales as tokens_group and the one-token loops
         * prefetch ahead of codes (tokens_group_slots, which prefetches codes
         * a panel ahead, leaves the scales to this). */
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) ulb_prefetch_ahead(group + t * ULB_TILE_SCALE_BYTES, pf_dist, a->prefetch_end);
        __m512i acc[ULB_NB_MAX][ULB_PANEL_TILES];
        if (bits == 1 && nb == 1 && a->lut1) {
            int32_t dot1[ULB_PANEL_ROWS] __attribute__((aligned(64)));
            ulb_lut1_group_avx512(codes, ks0, ks1, nt, a->lut1, pf_dist, a->prefetch_end, dot1);
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) acc[0][t] = _mm512_load_si512(dot1 + t * ULB_TILE);
        } else if (nb == 1)
            one_token_group(codes, ks0, ks1, x[0], pf_dist, a->prefetch_end, acc[0], nt, bits);
        else if (use_slots(bits, a->tokens))
            tokens_group_slots(codes, ks0, ks1, x, pf_dist && n0 == 0 ? ulb_panel_offset(w->ksteps, w->n_groups, 1) : 0,
                               a->prefetch_end, acc, nb, nt, bits);
        else
            tokens_group(codes, ks0, ks1, x, pf_dist, a->prefetch_end, acc, nb, nt, bits);
        group_out(w, a, n0, g, scales, acc, f, dots, nb, nt);
    }
#pragma GCC unroll 4
    for (int j = 0; j < nb; j++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) _mm512_storeu_ps(facc + j * ULB_PANEL_ROWS + t * ULB_TILE, f[j][t]);
}

#define ULB_CASE(BITS, PF, NB, NT)                                                                 \
    case (PF) * 64 + (NB) * 8 + (NT):                                                              \
        panel_body(w, tile0, a, n0, facc, dots, NB, NT, BITS, PF);                                 \
        return;
#define ULB_CASES_NB(BITS, PF, NB) \
    ULB_CASE(BITS, PF, NB, 1) ULB_CASE(BITS, PF, NB, 2) ULB_CASE(BITS, PF, NB, 3) ULB_CASE(BITS, PF, NB, 4)
#define ULB_CASES_PF(BITS, PF) \
    ULB_CASES_NB(BITS, PF, 1) ULB_CASES_NB(BITS, PF, 2) ULB_CASES_NB(BITS, PF, 3) ULB_CASES_NB(BITS, PF, 4)
#define ULB_CASES(BITS) ULB_CASES_PF(BITS, 0) ULB_CASES_PF(BITS, 1)

/* panel_1bit, panel_2bit, panel_4bit, panel_8bit: every (prefetch, tokens,
 * tiles) case compiled with the code width fixed. */
#define ULB_PANEL_FN(BITS)                                                                         \
    static void panel_##BITS##bit(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, \
                                  int64_t n0, int nb, float *facc, int32_t *dots) {                \
        switch ((a->prefetch_dist != 0) * 64 + nb * 8 + ntiles) { ULB_CASES(BITS) }              \
    }
ULB_PANEL_FN(1)
ULB_PANEL_FN(2)
ULB_PANEL_FN(4)
ULB_PANEL_FN(8)

static ULB_PANEL_BY_WIDTH(panel_vnni_avx512)

/* Tiles in LANES order (1-bit codes, made for AVX2 CPUs) go to the AVX2
 * kernels, which run here too and take them directly or transpose them. */
void ulb_panel_avx512(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0, int nb,
                      float *facc, int32_t *dots) {
    (w->tiles == ULB_TILES_LANES ? ulb_panel_avx2 : panel_vnni_avx512)(w, tile0, ntiles, a, n0, nb, facc, dots);
}
