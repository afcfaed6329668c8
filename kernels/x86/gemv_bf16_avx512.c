/* AVX-512 rows kernels of the one-token bf16 GEMV: a bf16 is the top half of
 * an fp32, so a shift (even columns) and a mask (odd columns) widen 32
 * weights, and 32 activations, into two fp32 vectors each, fused-multiply-
 * added in the order of ref/gemv_bf16_ref.c; four accumulator sets hide the
 * FMA latency. The activations stay bf16 and are widened again for every
 * chunk: as fp32 (4K bytes) they left L1 from K = 4096 on, and those L2
 * reads slowed the stream well below DRAM speed on Zen 4
 * (benchmarks/gemv_bf16.py).
 *
 * How many rows to read at once depends on the CPU (isa.c picks):
 * - one (ulb_gemv_bf16_rows_avx512): on Zen 4 one sequential stream reads
 *   about as fast as a plain read, and two rows per pass far slower;
 * - two, half a block apart (ulb_gemv_bf16_rows2_avx512): on the Xeon VM of
 *   benchmarks/results/xeon_amx one row fell short of the probe and two
 *   ran faster (benchmarks/c/ab_builds.sh, format 16); three were no better
 *   than two, and four spill their 32 accumulators. */
#pragma GCC target("avx512f,avx512bw")
#include <immintrin.h>

#include "../src/internal.h"

ALWAYS_INLINE void widen(__m512i v, __m512 *even, __m512 *odd) {
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* 32 columns of w (64 bytes, or the columns in `valid`) against x widened
 * to xe, xo, into sets e and o. */
ALWAYS_INLINE void chunk(const uint16_t *w, __m512 xe, __m512 xo, __mmask32 valid, __m512 *e, __m512 *o) {
    __m512 we, wo;
    widen(_mm512_maskz_loadu_epi16(valid, w), &we, &wo);
    *e = _mm512_fmadd_ps(we, xe, *e);
    *o = _mm512_fmadd_ps(wo, xo, *o);
}

/* ((v[i] + v[i+8]) then + v[i+4], + v[i+2], + v[i+1]), as the reference. */
ALWAYS_INLINE float reduce16(__m512 v) {
    const __m256 v8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
    const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    return _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)));
}

#define ROWS_LOCKSTEP 2 /* rows2's nr, and the most rows_lockstep takes */

/* Rows r, r + q, ..., r + (nr - 1) q (q unused with nr = 1), a 64-byte chunk
 * of each in turn, each row's sums in the reference's order; x is widened
 * once per chunk for all of them. */
ALWAYS_INLINE void rows_lockstep(const uint16_t *w, int64_t ldw, int64_t K, int64_t q, const int nr,
                                 const uint16_t *x, float *out) {
    const int64_t full = K / 32;
    const __mmask32 tail = (__mmask32)((1ull << (K % 32)) - 1);
    __m512 e[ROWS_LOCKSTEP][ULB_BF16_SETS], o[ROWS_LOCKSTEP][ULB_BF16_SETS];
    for (int j = 0; j < nr; j++)
        for (int s = 0; s < ULB_BF16_SETS; s++) e[j][s] = o[j][s] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + ULB_BF16_SETS <= full; c += ULB_BF16_SETS)
#pragma GCC unroll 4
        for (int s = 0; s < ULB_BF16_SETS; s++) {
            __m512 xe, xo;
            widen(_mm512_loadu_si512(x + 32 * (c + s)), &xe, &xo);
#pragma GCC unroll 2
            for (int j = 0; j < nr; j++)
                chunk(w + j * q * ldw + 32 * (c + s), xe, xo, ~(__mmask32)0, &e[j][s], &o[j][s]);
        }
    for (; c < full || (c == full && tail); c++) {
        const __mmask32 valid = c < full ? ~(__mmask32)0 : tail;
        __m512 xe, xo;
        widen(_mm512_maskz_loadu_epi16(valid, x + 32 * c), &xe, &xo);
#pragma GCC unroll 2
        for (int j = 0; j < nr; j++)
            chunk(w + j * q * ldw + 32 * c, xe, xo, valid, &e[j][c % ULB_BF16_SETS], &o[j][c % ULB_BF16_SETS]);
    }
    for (int j = 0; j < nr; j++) {
        const __m512 se = _mm512_add_ps(_mm512_add_ps(e[j][0], e[j][1]), _mm512_add_ps(e[j][2], e[j][3]));
        const __m512 so = _mm512_add_ps(_mm512_add_ps(o[j][0], o[j][1]), _mm512_add_ps(o[j][2], o[j][3]));
        out[j * q] = reduce16(_mm512_add_ps(se, so));
    }
}

/* The first nr * (rows / nr) rows nr at a time, rows / nr apart; the rest one by one. */
ALWAYS_INLINE void rows_in_lockstep(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                                    float *out, const int nr) {
    const int64_t q = rows / nr;
    for (int64_t r = 0; r < q; r++) rows_lockstep(w + r * ldw, ldw, K, q, nr, x, out + r);
    for (int64_t r = nr * q; r < rows; r++) rows_lockstep(w + r * ldw, ldw, K, 0, 1, x, out + r);
}

void ulb_gemv_bf16_rows_avx512(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                               float *out) {
    rows_in_lockstep(w, ldw, K, rows, x, out, 1);
}

void ulb_gemv_bf16_rows2_avx512(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                                float *out) {
    rows_in_lockstep(w, ldw, K, rows, x, out, ROWS_LOCKSTEP);
}
