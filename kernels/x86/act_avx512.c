/* AVX-512 per-token int8 quantisation of one contiguous row, with the group
 * sums of the result; bit-identical to ulb_quant_row_ref. */
#pragma GCC target("avx512f,avx512bw,avx512vl")
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "../src/internal.h"

static inline __mmask16 tail_mask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

static inline __mmask32 tail_mask32(int64_t left) {
    return left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
}

/* max |x| as an fp32 bit pattern, found on the integer bits: for
 * non-negative floats integer order is numeric order, and every Inf or NaN
 * pattern lies above every finite one, so one compare per element serves the
 * maximum and the finiteness check, with no conversion. */
static uint32_t absmax_bits(const void *x, ulb_dtype dt, int64_t K) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    int64_t k = 0;
    if (dt == ULB_DT_F32) {
        const float *p = x;
        const __m512i abs = _mm512_set1_epi32(0x7fffffff);
        for (; k + 32 <= K; k += 32) {
            a0 = _mm512_max_epu32(a0, _mm512_and_si512(_mm512_loadu_si512(p + k), abs));
            a1 = _mm512_max_epu32(a1, _mm512_and_si512(_mm512_loadu_si512(p + k + 16), abs));
        }
        for (; k < K; k += 16)
            a0 = _mm512_max_epu32(a0, _mm512_and_si512(_mm512_maskz_loadu_epi32(tail_mask16(K - k), p + k), abs));
        return _mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1));
    }
    const uint16_t *p = x;
    const __m512i abs = _mm512_set1_epi16(0x7fff);
    for (; k + 64 <= K; k += 64) {
        a0 = _mm512_max_epu16(a0, _mm512_and_si512(_mm512_loadu_si512(p + k), abs));
        a1 = _mm512_max_epu16(a1, _mm512_and_si512(_mm512_loadu_si512(p + k + 32), abs));
    }
    for (; k < K; k += 32)
        a0 = _mm512_max_epu16(a0, _mm512_and_si512(_mm512_maskz_loadu_epi16(tail_mask32(K - k), p + k), abs));
    const __m512i a = _mm512_max_epu16(a0, a1);
    const __m512i a32 = _mm512_max_epu32(_mm512_and_si512(a, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(a, 16));
    return _mm512_reduce_max_epu32(a32) << 16;
}

static inline __m512 load16(const void *x, ulb_dtype dt, int64_t k, __mmask16 m) {
    if (dt == ULB_DT_F32) return _mm512_maskz_loadu_ps(m, (const float *)x + k);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

float ulb_quant_row_avx512(const void *x, ulb_dtype dt, int64_t K, int64_t group, int8_t *q, int32_t *xsum) {
    const uint32_t bits = absmax_bits(x, dt, K);
    if (bits >= 0x7f800000u) return NAN;
    float amax;
    memcpy(&amax, &bits, sizeof amax);
    const float inv = 127.0f / fmaxf(amax, 1e-5f);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t g0 = 0; g0 < K; g0 += group) {
        const int64_t g1 = g0 + group < K ? g0 + group : K;
        __m512i sum = _mm512_setzero_si512();
        int64_t k = g0;
        if (dt == ULB_DT_BF16)
            for (; k + 32 <= g1; k += 32) {
                /* A bf16 is the high half of its fp32, so the even elements
                 * of 32 are a shift away and the odd ones a mask: no
                 * widening shuffle, and the two halves of each result dword
                 * are already the int16 pair in element order. */
                const __m512i v = _mm512_loadu_si512((const uint16_t *)x + k);
                const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
                const __m512i re = _mm512_cvt_roundps_epi32(_mm512_mul_ps(even, vinv),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m512i ro = _mm512_cvt_roundps_epi32(_mm512_mul_ps(odd, vinv),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                sum = _mm512_add_epi32(sum, _mm512_add_epi32(re, ro));
                /* Both lie in [-127, 127] (below), so dropping the high half
                 * of each int16 word is exact. */
                const __m512i w = _mm512_mask_blend_epi16(0xaaaaaaaau, re, _mm512_slli_epi32(ro, 16));
                _mm256_storeu_si256((__m256i *)(q + k), _mm512_cvtepi16_epi8(w));
            }
        for (; k < g1; k += 16) {
            const __mmask16 m = tail_mask16(g1 - k);
            /* |x * inv| <= 127 (1 + 2^-23), so rounding to nearest even lands
             * in [-127, 127]: the reference's clamp never bites, and the
             * saturating narrow below stands in for it. */
            const __m512i r = _mm512_cvt_roundps_epi32(_mm512_mul_ps(load16(x, dt, k, m), vinv),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            sum = _mm512_add_epi32(sum, r);
            const __m128i b = _mm512_cvtsepi32_epi8(r);
            if (m == 0xffff)
                _mm_storeu_si128((__m128i *)(q + k), b);
            else
                _mm_mask_storeu_epi8(q + k, m, b);
        }
        *xsum++ = _mm512_reduce_add_epi32(sum);
    }
    return inv;
}
