/* AVX-512 per-token int8 quantisation of one contiguous row; bit-identical
 * to ulb_quant_row_ref (same fp32 multiply, round-to-nearest-even, clamp). */
#pragma GCC target("avx512f,avx512bw,avx512vl")
#include <immintrin.h>
#include <math.h>

#include "../src/internal.h"

static inline __m512 load16(const void *x, ulb_dtype dt, int64_t k, __mmask16 m) {
    if (dt == ULB_DT_F32) return _mm512_maskz_loadu_ps(m, (const float *)x + k);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

float ulb_quant_row_avx512(const void *x, ulb_dtype dt, int64_t K, int8_t *q) {
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = tail_mask(K - k);
        const __m512 v = load16(x, dt, k, m);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float a = _mm512_reduce_max_ps(amax);
    if (nan || !isfinite(a)) return NAN;
    const float inv = 127.0f / fmaxf(a, 1e-5f);
    const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = tail_mask(K - k);
        __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load16(x, dt, k, m), vinv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
        _mm512_mask_cvtepi32_storeu_epi8(q + k, m, _mm512_cvtps_epi32(r));
    }
    return inv;
}
