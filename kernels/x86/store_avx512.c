/* AVX-512 output step of a panel: activation scale, bias, rounding to the
 * output dtype, 16 rows per instruction; whole lines of y streamed past the
 * caches where the call asks (ulb_out.stream); faster than the scalar step
 * on short rows (benchmarks/c/ab_builds.sh). Must match ref/store_ref.c bit
 * for bit. */
#pragma GCC target("avx512f,avx512bw,avx512vl")
#include <immintrin.h>

#include "../src/internal.h"

/* ulb_f32_to_bf16 on 16 lanes: round to nearest even, NaN kept and quieted. */
ALWAYS_INLINE __m256i f32_to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __m512i quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, quiet));
}

ALWAYS_INLINE __m512 load_elems(const void *p, ulb_dtype dt, int64_t i, __mmask16 m) {
    if (dt == ULB_DT_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 rows of token j from row r on (m: those kept), scaled and biased. */
ALWAYS_INLINE __m512 out_rows(const ulb_out *o, const float *facc, int j, __m512 xs, int64_t m0, int64_t r,
                              __mmask16 m) {
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, facc + j * ULB_PANEL_ROWS + r), xs);
    if (o->bias) v = _mm512_add_ps(v, load_elems(o->bias, o->bias_dt, m0 + r, m));
    return v;
}

/* The whole lines of y that rows [0, rows) fill, with non-temporal stores,
 * if y is 64-byte aligned at row 0; returns the first row not written. */
static int64_t stream_lines(const ulb_out *o, const float *facc, int j, __m512 xs, int64_t yrow, int64_t m0,
                            int64_t rows) {
    const int64_t per_line = o->y_dt == ULB_DT_F32 ? 16 : 32;
    const size_t esize = o->y_dt == ULB_DT_F32 ? 4 : 2;
    char *y = (char *)o->y + (size_t)yrow * esize;
    if ((uintptr_t)y % 64) return 0;
    int64_t r = 0;
    for (; r + per_line <= rows; r += per_line, y += 64) {
        const __m512 v0 = out_rows(o, facc, j, xs, m0, r, 0xFFFF);
        if (o->y_dt == ULB_DT_F32) {
            _mm512_stream_ps((float *)y, v0);
        } else {
            const __m512 v1 = out_rows(o, facc, j, xs, m0, r + 16, 0xFFFF);
            _mm512_stream_si512((void *)y, _mm512_inserti64x4(_mm512_castsi256_si512(f32_to_bf16(v0)),
                                                              f32_to_bf16(v1), 1));
        }
    }
    if (r) _mm_sfence(); /* the stores are weakly ordered: visible before the caller's join */
    return r;
}

void ulb_store_rows_avx512(const ulb_out *o, const float *facc, int64_t n0, int nb, int64_t m0, int64_t rows) {
    for (int j = 0; j < nb; j++) {
        const __m512 xs = _mm512_set1_ps(o->xscale[n0 + j]);
        const int64_t yrow = (n0 + j) * o->ldy + m0;
        for (int64_t r = o->stream ? stream_lines(o, facc, j, xs, yrow, m0, rows) : 0; r < rows; r += 16) {
            const __mmask16 m = rows - r >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (rows - r)) - 1);
            const __m512 v = out_rows(o, facc, j, xs, m0, r, m);
            if (o->y_dt == ULB_DT_F32)
                _mm512_mask_storeu_ps((float *)o->y + yrow + r, m, v);
            else
                _mm256_mask_storeu_epi16((uint16_t *)o->y + yrow + r, m, f32_to_bf16(v));
        }
    }
}
