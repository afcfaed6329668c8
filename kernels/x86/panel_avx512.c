/* AVX-512 VNNI microkernels (1-bit and 2-bit codes), up to 64 rows x 4 tokens
 * per call. u8 codes x s8 activations with vpdpbusd; the affine level map is
 * applied once per group (see internal.h), so one instruction serves every
 * format. Must match ref/panel_ref.c bit for bit. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>
#include <string.h>

#include "../src/internal.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* The four VNNI4 u8 operands (k-quads s = 0..3) of one 16 x 16 tile. */
ALWAYS_INLINE void unpack_tile(const uint8_t *tp, const int bits, __m512i u[4]) {
    if (bits == 2) {
        const __m512i three = _mm512_set1_epi8(3);
        const __m512i v = _mm512_loadu_si512(tp);
        u[0] = _mm512_and_si512(v, three);
        u[1] = _mm512_and_si512(_mm512_srli_epi16(v, 2), three);
        u[2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), three);
        u[3] = _mm512_and_si512(_mm512_srli_epi16(v, 6), three);
    } else {
        /* A qword of codes is a byte mask: one masked move expands it. */
        const __m512i one = _mm512_set1_epi8(1);
        for (int s = 0; s < 4; s++) {
            uint64_t m;
            memcpy(&m, tp + 8 * s, sizeof m);
            u[s] = _mm512_maskz_mov_epi8(_cvtu64_mask64(m), one);
        }
    }
}

ALWAYS_INLINE void panel_body(const ulb_weight *w, int64_t tile0, const ulb_acts *a, int64_t n0,
                              float *facc, int32_t *dots, const int nb, const int nt,
                              const int bits) {
    const int64_t tb = ulb_tile_bytes(bits);
    const uint8_t *base = w->codes + ulb_panel_offset(bits, w->K_pad, tile0 / ULB_PANEL_TILES);
    const int8_t *x[ULB_NB_MAX];
    for (int j = 0; j < nb; j++) x[j] = a->xq + (n0 + j) * a->ldq;
    const __m512i va = _mm512_set1_epi32(w->level_a);
    __m512 f[ULB_NB_MAX][ULB_PANEL_TILES];
#pragma GCC unroll 16
    for (int j = 0; j < nb; j++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) f[j][t] = _mm512_setzero_ps();

    for (int64_t g = 0; g < w->n_groups; g++) {
        const int64_t ks0 = g * w->gsteps;
        const int64_t ks1 = ks0 + w->gsteps < w->ksteps ? ks0 + w->gsteps : w->ksteps;
        __m512i acc[ULB_NB_MAX][ULB_PANEL_TILES];
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
            for (int j = 0; j < nb; j++) acc[j][t] = _mm512_setzero_si512();
        if (nb == 1 && bits == 2) {
            /* One token: no shifts. Masking field s in place leaves 4^s * q,
             * so each field gets its own accumulator, scaled back exactly
             * (an arithmetic shift of a multiple of 4^s) once per group. */
            __m512i f4[4][ULB_PANEL_TILES];
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++)
                f4[0][t] = f4[1][t] = f4[2][t] = f4[3][t] = _mm512_setzero_si512();
            for (int64_t ks = ks0; ks < ks1; ks++) {
                const int8_t *xk = x[0] + ks * ULB_TILE;
#pragma GCC unroll 4
                for (int s = 0; s < 4; s++) {
                    const __m512i field = _mm512_set1_epi8((char)(3 << (2 * s)));
                    const __m512i xb = bcast4(xk + 4 * s);
#pragma GCC unroll 4
                    for (int t = 0; t < nt; t++) {
                        const __m512i v = _mm512_loadu_si512(base + (ks * nt + t) * tb);
                        f4[s][t] = _mm512_dpbusd_epi32(f4[s][t], _mm512_and_si512(v, field), xb);
                    }
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++)
                acc[0][t] = _mm512_add_epi32(
                    _mm512_add_epi32(f4[0][t], _mm512_srai_epi32(f4[1][t], 2)),
                    _mm512_add_epi32(_mm512_srai_epi32(f4[2][t], 4), _mm512_srai_epi32(f4[3][t], 6)));
        } else {
            for (int64_t ks = ks0; ks < ks1; ks++) {
#pragma GCC unroll 4
                for (int t = 0; t < nt; t++) {
                    __m512i u[4];
                    unpack_tile(base + (ks * nt + t) * tb, bits, u);
#pragma GCC unroll 4
                    for (int j = 0; j < nb; j++) {
                        const int8_t *xk = x[j] + ks * ULB_TILE;
#pragma GCC unroll 4
                        for (int s = 0; s < 4; s++)
                            acc[j][t] = _mm512_dpbusd_epi32(acc[j][t], u[s], bcast4(xk + 4 * s));
                    }
                }
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < nb; j++) {
            const __m512i vb =
                _mm512_set1_epi32(w->level_b * a->xsum[(n0 + j) * w->n_groups + g]);
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) {
                const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(acc[j][t], va), vb);
                const __m512 s =
                    _mm512_loadu_ps(w->scales + g * w->M_pad + (tile0 + t) * ULB_TILE);
                f[j][t] = _mm512_add_ps(f[j][t], _mm512_mul_ps(s, _mm512_cvtepi32_ps(dot)));
                if (dots)
                    _mm512_storeu_si512(dots + (j * w->n_groups + g) * ULB_PANEL_ROWS + t * ULB_TILE,
                                        dot);
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < nb; j++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
            _mm512_storeu_ps(facc + j * ULB_PANEL_ROWS + t * ULB_TILE, f[j][t]);
}

#define ULB_CASE(BITS, NB, NT)                                                                     \
    case (NB) * 8 + (NT):                                                                          \
        panel_body(w, tile0, a, n0, facc, dots, NB, NT, BITS);                                     \
        return;
#define ULB_CASES_NB(BITS, NB) ULB_CASE(BITS, NB, 1) ULB_CASE(BITS, NB, 2) ULB_CASE(BITS, NB, 3) ULB_CASE(BITS, NB, 4)
#define ULB_CASES(BITS) ULB_CASES_NB(BITS, 1) ULB_CASES_NB(BITS, 2) ULB_CASES_NB(BITS, 3) ULB_CASES_NB(BITS, 4)

static void panel_2bit(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0,
                       int nb, float *facc, int32_t *dots) {
    switch (nb * 8 + ntiles) { ULB_CASES(2) }
}

static void panel_1bit(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a, int64_t n0,
                       int nb, float *facc, int32_t *dots) {
    switch (nb * 8 + ntiles) { ULB_CASES(1) }
}

void ulb_panel_avx512(const ulb_weight *w, int64_t tile0, int ntiles, const ulb_acts *a,
                      int64_t n0, int nb, float *facc, int32_t *dots) {
    if (w->bits == 2)
        panel_2bit(w, tile0, ntiles, a, n0, nb, facc, dots);
    else
        panel_1bit(w, tile0, ntiles, a, n0, nb, facc, dots);
}
