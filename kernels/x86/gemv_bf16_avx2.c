/* AVX2 rows kernel of the one-token bf16 GEMV: the AVX-512 kernel's
 * arithmetic with each 16-lane vector held as two 8-lane halves (columns
 * 0-15 and 16-31 of a chunk), so every operation and its order match
 * ref/gemv_bf16_ref.c bit for bit. */
#pragma GCC target("avx2,fma")
#include <immintrin.h>
#include <string.h>

#include "../src/internal.h"

#define ROWS_LOCKSTEP 4

typedef struct {
    __m256 lo, hi; /* lanes 0-7, 8-15 */
} v16;

ALWAYS_INLINE void widen(__m256i v, __m256 *even, __m256 *odd) {
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 32 columns at w and x (64 bytes each, readable) into sets e and o. */
ALWAYS_INLINE void chunk(const uint16_t *w, const uint16_t *x, v16 *e, v16 *o) {
    for (int h = 0; h < 2; h++) {
        __m256 we, wo, xe, xo;
        widen(_mm256_loadu_si256((const __m256i *)(w + 16 * h)), &we, &wo);
        widen(_mm256_loadu_si256((const __m256i *)(x + 16 * h)), &xe, &xo);
        if (h) {
            e->hi = _mm256_fmadd_ps(we, xe, e->hi);
            o->hi = _mm256_fmadd_ps(wo, xo, o->hi);
        } else {
            e->lo = _mm256_fmadd_ps(we, xe, e->lo);
            o->lo = _mm256_fmadd_ps(wo, xo, o->lo);
        }
    }
}

ALWAYS_INLINE v16 add16(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }

/* ((v[i] + v[i+8]) then + v[i+4], + v[i+2], + v[i+1]), as the reference. */
ALWAYS_INLINE float reduce16(v16 v) {
    const __m256 v8 = _mm256_add_ps(v.lo, v.hi);
    const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
    const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    return _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)));
}

/* Rows r, r + q, ..., r + (nr - 1) q (q = 0 with nr = 1), a 64-byte chunk of
 * each in turn, each row's sums in the reference's order. */
ALWAYS_INLINE void rows_lockstep(const uint16_t *w, int64_t ldw, int64_t K, int64_t q, const int nr,
                                 const uint16_t *x, const uint16_t *xt, float *out) {
    const int64_t full = K / 32, rest = K % 32;
    const v16 zero = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    v16 e[ROWS_LOCKSTEP][ULB_BF16_SETS], o[ROWS_LOCKSTEP][ULB_BF16_SETS];
#pragma GCC unroll 4
    for (int j = 0; j < nr; j++)
        for (int s = 0; s < ULB_BF16_SETS; s++) e[j][s] = o[j][s] = zero;
    int64_t c = 0;
    for (; c + ULB_BF16_SETS <= full; c += ULB_BF16_SETS)
#pragma GCC unroll 4
        for (int s = 0; s < ULB_BF16_SETS; s++)
#pragma GCC unroll 4
            for (int j = 0; j < nr; j++) chunk(w + j * q * ldw + 32 * (c + s), x + 32 * (c + s), &e[j][s], &o[j][s]);
    for (; c < full; c++)
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++)
            chunk(w + j * q * ldw + 32 * c, x + 32 * c, &e[j][c % ULB_BF16_SETS], &o[j][c % ULB_BF16_SETS]);
#pragma GCC unroll 4
    for (int j = 0; j < nr; j++) {
        if (rest) {
            uint16_t wt[32] = {0};
            memcpy(wt, w + j * q * ldw + 32 * full, (size_t)rest * sizeof(uint16_t));
            chunk(wt, xt, &e[j][c % ULB_BF16_SETS], &o[j][c % ULB_BF16_SETS]);
        }
        const v16 se = add16(add16(e[j][0], e[j][1]), add16(e[j][2], e[j][3]));
        const v16 so = add16(add16(o[j][0], o[j][1]), add16(o[j][2], o[j][3]));
        out[j * q] = reduce16(add16(se, so));
    }
}

/* Four rows at once, a quarter of the block apart: a Zen 3 core reads DRAM
 * far faster as several runs, a line of each in turn, than as one, and the
 * rows of a block are one run (two rows gain less; reading 1-4 KiB of each
 * of two rows in turn lost). The accumulators spill, which costs nothing
 * next to the DRAM time of a chunk. */
void ulb_gemv_bf16_rows_avx2(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                             float *out) {
    const int64_t full = K / 32, rest = K % 32, q = rows / ROWS_LOCKSTEP;
    uint16_t xt[32] = {0}; /* the last partial chunk, zero padded */
    memcpy(xt, x + 32 * full, (size_t)rest * sizeof(uint16_t));
    for (int64_t r = 0; r < q; r++) rows_lockstep(w + r * ldw, ldw, K, q, ROWS_LOCKSTEP, x, xt, out + r);
    for (int64_t r = ROWS_LOCKSTEP * q; r < rows; r++) rows_lockstep(w + r * ldw, ldw, K, 0, 1, x, xt, out + r);
}
