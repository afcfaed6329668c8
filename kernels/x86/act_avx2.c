/* AVX2 per-token int8 quantisation of one contiguous row; bit-identical to
 * ulb_quant_row_ref. The last K % 8 elements and the group sums go through
 * the reference. */
#pragma GCC target("avx2")
#include <immintrin.h>
#include <math.h>

#include "../src/dtype.h"
#include "../src/internal.h"

static inline __m256 load8(const void *x, ulb_dtype dt, int64_t k) {
    if (dt == ULB_DT_F32) return _mm256_loadu_ps((const float *)x + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

float ulb_quant_row_avx2(const void *x, ulb_dtype dt, int64_t K, int64_t group, int8_t *q, int32_t *xsum) {
    const int64_t K8 = K / 8 * 8;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
        const __m256 v = load8(x, dt, k);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        amax = _mm256_max_ps(amax, _mm256_and_ps(v, absmask));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, amax);
    float a = 0.0f;
    for (int i = 0; i < 8; i++) a = fmaxf(a, lanes[i]);
    int finite = _mm256_movemask_ps(nan) == 0;
    for (int64_t k = K8; k < K; k++) {
        const float v = ulb_load_elem(x, dt, k);
        if (isnan(v)) finite = 0;
        a = fmaxf(a, fabsf(v));
    }
    if (!finite || !isfinite(a)) return NAN;
    const float inv = 127.0f / fmaxf(a, 1e-5f);
    const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-128.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t k = 0; k < K8; k += 8) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(load8(x, dt, k), vinv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        const __m256i i32 = _mm256_cvtps_epi32(r);
        const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64((__m128i *)(q + k), _mm_packs_epi16(i16, i16));
    }
    ulb_quant_tail_ref(x, dt, K8, K, inv, q);
    ulb_group_sums_ref(q, K, group, xsum);
    return inv;
}
