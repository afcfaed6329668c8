/* AVX-512 rows kernel of the one-token bf16 GEMV: a bf16 is the top half of
 * an fp32, so a shift (even columns) and a mask (odd columns) widen 32
 * weights, and 32 activations, into two fp32 vectors each, fused-multiply-
 * added in the order of ref/gemv_bf16_ref.c. One row at a time keeps the
 * read one sequential stream; four accumulator sets hide the FMA latency.
 * The activations stay bf16 and are widened again for every row: as fp32
 * (4K bytes) they left L1 from K = 4096 on, and those L2 reads cut the
 * stream to 35-70% of DRAM speed (benchmarks/gemv_bf16.py). Two rows per
 * pass over them (two streams) ran at 40-60%: one core here streams well
 * only one sequential stream at a time. */
#pragma GCC target("avx512f,avx512bw")
#include <immintrin.h>

#include "../src/internal.h"

ALWAYS_INLINE void widen(__m512i v, __m512 *even, __m512 *odd) {
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}

ALWAYS_INLINE void chunk(const uint16_t *w, const uint16_t *x, __mmask32 valid, __m512 *e, __m512 *o) {
    __m512 we, wo, xe, xo;
    widen(_mm512_maskz_loadu_epi16(valid, w), &we, &wo);
    widen(_mm512_maskz_loadu_epi16(valid, x), &xe, &xo);
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

void ulb_gemv_bf16_rows_avx512(const uint16_t *w, int64_t ldw, int64_t K, int64_t rows, const uint16_t *x,
                               float *out) {
    const int64_t full = K / 32;
    const __mmask32 tail = (__mmask32)((1ull << (K % 32)) - 1);
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *wr = w + r * ldw;
        __m512 e[ULB_BF16_SETS], o[ULB_BF16_SETS];
        for (int s = 0; s < ULB_BF16_SETS; s++) e[s] = o[s] = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + ULB_BF16_SETS <= full; c += ULB_BF16_SETS)
#pragma GCC unroll 4
            for (int s = 0; s < ULB_BF16_SETS; s++)
                chunk(wr + 32 * (c + s), x + 32 * (c + s), ~(__mmask32)0, &e[s], &o[s]);
        for (; c < full; c++) chunk(wr + 32 * c, x + 32 * c, ~(__mmask32)0, &e[c % ULB_BF16_SETS], &o[c % ULB_BF16_SETS]);
        if (tail) chunk(wr + 32 * c, x + 32 * c, tail, &e[c % ULB_BF16_SETS], &o[c % ULB_BF16_SETS]);
        const __m512 se = _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3]));
        const __m512 so = _mm512_add_ps(_mm512_add_ps(o[0], o[1]), _mm512_add_ps(o[2], o[3]));
        out[r] = reduce16(_mm512_add_ps(se, so));
    }
}
