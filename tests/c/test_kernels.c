/* C unit test of kernels/: every ISA this CPU runs equals the scalar
 * reference bit for bit (integer dots, extremes included, and fp32 outputs of
 * the low-bit GEMV and GEMM, fp32 outputs of the bf16 GEMV), on odd shapes;
 * ulb_linear's other inputs too (fp32 / bf16 activations and output, fp32 /
 * bf16 / no bias, strided x, padded y), where each ISA also equals the scalar
 * ISA on contiguous x and a double-precision reference; and the read probe
 * sums what it reads, as one run or several, through its AVX2 loop and
 * through ulb_read_probe_streams. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../kernels/src/dtype.h"
#include "../../kernels/src/internal.h"

static uint32_t rng = 12345;
static uint32_t rnd(void) { rng = rng * 1664525u + 1013904223u; return rng >> 8; }

/* The integer accumulators of every ISA against the scalar reference's, bit
 * for bit: N tokens of int8 activations drawn over the whole range (or all
 * equal to extreme when it is not 0, when every dot must also equal *want),
 * zero beyond K as the kernels pad them. */
static int check_int_dots(const uint8_t *blob, int64_t nb, int64_t N, int extreme, const int64_t *want) {
    ulb_weight w;
    if (ulb_weight_view(blob, nb, &w)) { printf("bad blob\n"); return 1; }
    const int64_t G = w.n_groups, group = w.gsteps * ulb_tile_k(w.bits);
    int8_t *xq = calloc(N * w.K_pad, 1);
    int32_t *xsum = calloc(N * G, 4), *dots[ULB_ISA_COUNT];
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < w.K; k++) {
            xq[n * w.K_pad + k] = extreme ? (int8_t)extreme : (int8_t)(rnd() % 256 - 128);
            xsum[n * G + k / group] += xq[n * w.K_pad + k];
        }
    int fails = 0;
    for (int isa = 0; isa < ULB_ISA_COUNT; isa++) {
        dots[isa] = calloc(N * w.M * G, 4);
        if (!ulb_isa_supported(isa)) continue;
        ulb_isa_set(isa);
        if (ulb_int_dots(blob, nb, N, xq, xsum, dots[isa])) { printf("int_dots failed\n"); fails++; continue; }
        if (!isa && want)
            for (int64_t i = 0; i < N * w.M * G; i++)
                if (dots[0][i] != *want) {
                    printf("extremes: %d != %ld (bits %d)\n", dots[0][i], (long)*want, w.bits);
                    fails++;
                    break;
                }
        if (isa && memcmp(dots[0], dots[isa], N * w.M * G * 4)) {
            printf("INT DOTS MISMATCH bits=%d M=%ld K=%ld G=%ld N=%ld isa=%s%s\n", w.bits, (long)w.M, (long)w.K,
                   (long)G, (long)N, ulb_isa_name(isa), extreme ? " (extremes)" : "");
            fails++;
        }
    }
    for (int isa = 0; isa < ULB_ISA_COUNT; isa++) free(dots[isa]);
    free(xq); free(xsum);
    return fails;
}

/* Every format of the table in every CPU tile order it offers (forms_init). */
#define MAX_FORMS 64
static struct form {
    int fmt, tiles;
} FORMS[MAX_FORMS];
static int N_FORMS;

/* FORMS from the format table, and the table's own consistency: ids unique
 * and found by ulb_format_get, tile_k = 32 / bits (20: five base-3 codes of
 * four columns), codes within their bits,
 * levels within int8 (the kernels keep them in bytes), level_a 1 or 2 (the
 * AMX GEMM adds codes once or twice), every format in VNNI tiles. */
static int forms_init(int *n) {
    int fails = 0;
    fails += ulb_format_info_size() != sizeof(ulb_format_info) || ulb_format_at(-1) ||
             ulb_format_at(ulb_format_count()) || ulb_format_get(0) || ulb_format_count() < 1;
    fails += ulb_constants_size() != sizeof(ulb_constants);
    ulb_constants c;
    ulb_constants_get(&c);
    fails += c.max_k != ULB_MAX_K || c.max_m != ULB_MAX_M || c.tiles_count != ULB_TILES_COUNT ||
             c.prefetch_max != ULB_PREFETCH_MAX || c.slowdown_max != ULB_SLOWDOWN_MAX;
    for (int t = 0; t < ULB_TILES_COUNT; t++) fails += ulb_tiles_name(t) == NULL;
    fails += ulb_tiles_name(ULB_TILES_COUNT) != NULL;
    for (int i = 0; i < ulb_format_count(); i++) {
        const ulb_format_info *fi = ulb_format_at(i);
        const int lo = fi->level_b, hi = fi->level_a * fi->max_code + fi->level_b;
        const int tile_k = fi->bits == ULB_BASE3_BITS ? 4 * 5 : 32 / fi->bits;
        if (ulb_format_get(fi->id) != fi || fi->tile_k != tile_k || fi->max_code >= (1 << fi->bits) ||
            fi->max_code < 1 || lo < -128 || hi > 127 || (fi->level_a != 1 && fi->level_a != 2) ||
            !(fi->tiles & (1u << ULB_TILES_VNNI)) || fi->tiles >> ULB_TILES_COUNT || !fi->name || !fi->aliases ||
            !fi->bits_name || !fi->module) {
            printf("format table row %d (%s) inconsistent\n", i, fi->name);
            fails++;
        }
        for (int t = 0; t < ULB_TILES_COUNT; t++)
            if (fi->tiles >> t & 1 && t != ULB_TILES_KMAJOR && N_FORMS < MAX_FORMS)
                FORMS[N_FORMS++] = (struct form){fi->id, t};
    }
    (*n)++;
    return fails;
}

/* Largest codes times -128 and times 127 over a long single group: the
 * widest 16- and 32-bit sums any kernel keeps (-128 zeroes the 1-bit lookup
 * tables, 127 fills them), against the closed form too. */
static int check_int_extremes(int fmt, int tiles, int64_t K, int64_t N) {
    const ulb_format_info *fi = ulb_format_get(fmt);
    const int64_t M = 16, nb = ulb_packed_nbytes(fmt, M, K, 0);
    uint8_t *codes = malloc(M * K), *blob = malloc(nb);
    float *sc = malloc(M * 4);
    memset(codes, fi->max_code, M * K);
    for (int64_t m = 0; m < M; m++) sc[m] = 1.0f;
    int fails = ulb_pack_tiles(fmt, tiles, M, K, 0, codes, K, sc, blob, nb) != ULB_OK;
    for (int x = -128; x <= 127 && !fails; x += 255) {
        const int64_t want = (int64_t)(fi->level_a * fi->max_code + fi->level_b) * x * K;
        fails += check_int_dots(blob, nb, N, x, &want);
    }
    free(codes); free(blob); free(sc);
    return fails;
}

/* gs, or for a format whose tile it does not divide (base 3's 20 columns)
 * the next multiple of the tile: the group sizes below are the bit-field
 * formats' cases. */
static int64_t fit_gs(const ulb_format_info *fi, int64_t gs) {
    return gs <= 0 || gs % fi->tile_k == 0 ? gs : (gs + fi->tile_k - 1) / fi->tile_k * fi->tile_k;
}

static int check(int fmt, int tiles, int64_t M, int64_t K, int64_t gs, int64_t N) {
    const ulb_format_info *fi = ulb_format_get(fmt);
    gs = fit_gs(fi, gs);
    int64_t nb = ulb_packed_nbytes(fmt, M, K, gs);
    if (nb < 0) { printf("nbytes error %s\n", ulb_status_str((ulb_status)-nb)); return 1; }
    int64_t G = gs <= 0 || gs >= K ? 1 : (K + gs - 1) / gs;
    uint8_t *codes = malloc(M * K), *blob = malloc(nb), *codes2 = malloc(M * K);
    float *sc = malloc(M * G * 4), *sc2 = malloc(M * G * 4);
    for (int64_t i = 0; i < M * K; i++) codes[i] = rnd() % (fi->max_code + 1);
    for (int64_t i = 0; i < M * G; i++) sc[i] = (rnd() % 1000 + 1) * 1e-3f;
    if (ulb_pack_tiles(fmt, tiles, M, K, gs, codes, K, sc, blob, nb)) { printf("pack failed\n"); return 1; }
    ulb_unpack(blob, nb, codes2, sc2);
    if (memcmp(codes, codes2, M * K) || memcmp(sc, sc2, M * G * 4)) { printf("unpack mismatch\n"); return 1; }
    /* The kernels' prefetch bound (ulb_weight_panels_end) must end where the blob's panels do. */
    ulb_weight w;
    ulb_weight_view(blob, nb, &w);
    if (ulb_weight_panels_end(&w, ulb_weight_npanels(&w)) + 64 != blob + nb) {
        printf("panels end mismatch fmt=%d M=%ld K=%ld gs=%ld\n", fmt, (long)M, (long)K, (long)gs);
        return 1;
    }
    float *x = malloc(N * K * 4);
    for (int64_t i = 0; i < N * K; i++) x[i] = ((int)(rnd() % 2001) - 1000) * 1e-3f;
    float *y[ULB_ISA_COUNT];
    int fails = 0;
    for (int isa = 0; isa < ULB_ISA_COUNT; isa++) {
        y[isa] = calloc(N * M, 4);
        if (!ulb_isa_supported(isa)) continue;
        ulb_isa_set(isa);
        ulb_status st = ulb_linear(blob, nb, N, x, ULB_DT_F32, K, 1, NULL, ULB_DT_F32, y[isa], ULB_DT_F32, M, 2);
        if (st) { printf("linear failed %s\n", ulb_status_str(st)); return 1; }
        if (isa && memcmp(y[0], y[isa], N * M * 4)) {
            printf("MISMATCH fmt=%d tiles=%d M=%ld K=%ld gs=%ld N=%ld isa=%s\n", fmt, tiles, (long)M, (long)K, (long)gs,
                   (long)N, ulb_isa_name(isa));
            for (int64_t i = 0; i < N * M; i++) if (y[0][i] != y[isa][i]) { printf("  first at %ld: %g vs %g\n", (long)i, y[0][i], y[isa][i]); break; }
            fails++;
        }
    }
    for (int isa = 0; isa < ULB_ISA_COUNT; isa++) free(y[isa]);
    fails += check_int_dots(blob, nb, N, 0, NULL);
    free(codes); free(codes2); free(blob); free(sc); free(sc2); free(x);
    return fails;
}

static uint16_t rnd_bf16(void) { /* a finite bf16 of either sign, magnitude ~2^-8..2^7 */
    return (uint16_t)((rnd() & 0x8000u) | ((120u + rnd() % 16u) << 7) | (rnd() & 0x7fu));
}

static int check_bf16(int64_t M, int64_t K, int64_t ldw, int64_t incx) {
    uint16_t *w = malloc(M * ldw * 2), *x = malloc(K * incx * 2), *b = malloc(M * 2);
    for (int64_t i = 0; i < M * ldw; i++) w[i] = rnd_bf16();
    for (int64_t i = 0; i < K * incx; i++) x[i] = rnd_bf16();
    for (int64_t i = 0; i < M; i++) b[i] = rnd_bf16();
    float *y[ULB_ISA_COUNT];
    int fails = 0;
    for (int isa = 0; isa < ULB_ISA_COUNT; isa++) {
        y[isa] = calloc(M, 4);
        if (!ulb_isa_supported(isa)) continue;
        ulb_isa_set(isa);
        ulb_status st = ulb_gemv_bf16(w, M, K, ldw, x, incx, b, ULB_DT_BF16, y[isa], ULB_DT_F32, 2);
        if (st) { printf("gemv_bf16 failed %s\n", ulb_status_str(st)); return 1; }
        if (isa && memcmp(y[0], y[isa], M * 4)) {
            printf("MISMATCH bf16 gemv M=%ld K=%ld isa=%s\n", (long)M, (long)K, ulb_isa_name(isa));
            fails++;
        }
    }
    for (int isa = 0; isa < ULB_ISA_COUNT; isa++) free(y[isa]);
#if defined(__x86_64__)
    /* Both AVX-512 rows kernels, whichever this CPU's vendor gets: row counts
     * from 1 to M (odd ones leave a row outside the lockstep pairs). */
    if (ulb_isa_supported(ULB_ISA_AVX512) && incx == 1) {
        const ulb_gemv_bf16_rows_fn kernels[2] = {ulb_gemv_bf16_rows_avx512, ulb_gemv_bf16_rows2_avx512};
        float *want = calloc(M, 4), *got = calloc(M, 4);
        for (int64_t rows = 1; rows <= M; rows += rows < 9 ? 1 : 17) {
            ulb_gemv_bf16_rows_ref(w, ldw, K, rows, x, want);
            for (int k = 0; k < 2; k++) {
                kernels[k](w, ldw, K, rows, x, got);
                if (memcmp(want, got, rows * 4)) {
                    printf("MISMATCH bf16 rows kernel %d M=%ld K=%ld rows=%ld\n", k + 1, (long)M, (long)K, (long)rows);
                    fails++;
                }
            }
        }
        free(want); free(got);
    }
#endif
    free(w); free(x); free(b);
    return fails;
}

/* Layouts of x (N x K) that ulb_linear takes, as the op passes a tensor's
 * strides (csrc/ops.cpp): element (n, k) at n * ldx + k * incx. */
enum { X_CONTIG, X_PADDED, X_STRIDED, X_TRANSPOSED, X_BROADCAST, X_LAYOUTS };
static const char *const x_layout_name[X_LAYOUTS] = {"contig", "padded", "strided", "transposed", "broadcast"};

static void x_strides(int layout, int64_t N, int64_t K, int64_t *ldx, int64_t *incx) {
    switch (layout) {
    case X_PADDED: *ldx = K + 3, *incx = 1; return;          /* rows of a wider tensor: SIMD quantiser */
    case X_STRIDED: *ldx = 3 * K + 5, *incx = 3; return;     /* ldx > K, incx > 1: strided quantiser */
    case X_TRANSPOSED: *ldx = 1, *incx = N; return;          /* x.t() of a contiguous K x N */
    case X_BROADCAST: *ldx = 0, *incx = 1; return;           /* x.expand(N, K): one row for all tokens */
    default: *ldx = K, *incx = 1; return;
    }
}

/* One ulb_linear configuration: x of x_dt in `layout`, bias of bias_dt (none
 * with has_bias 0), y of y_dt with row stride ldy (> M except for contiguous
 * x), nthreads 2. Checks, bit for bit: every ISA's y (padding of y included,
 * left untouched) against the scalar ISA's, and the scalar ISA's against its y
 * from a contiguous copy of x; then the scalar y against a double-precision
 * reference from the unpacked codes and activations quantised here. Elements
 * of x's buffer outside the N x K view are NaN, so reading one shows. */
#define YGUARD 64 /* bytes past y that must stay untouched */
static int check_linear(int fmt, int tiles, int64_t M, int64_t K, int64_t gs, int64_t N, ulb_dtype x_dt, int layout,
                        int has_bias, ulb_dtype bias_dt, ulb_dtype y_dt) {
    const ulb_format_info *fi = ulb_format_get(fmt);
    gs = fit_gs(fi, gs);
    const int64_t nb = ulb_packed_nbytes(fmt, M, K, gs);
    if (nb < 0) { printf("nbytes error %s\n", ulb_status_str((ulb_status)-nb)); return 1; }
    const int64_t G = gs <= 0 || gs >= K ? 1 : (K + gs - 1) / gs;
    uint8_t *codes = malloc(M * K), *blob = malloc(nb);
    float *sc = malloc(M * G * 4);
    for (int64_t i = 0; i < M * K; i++) codes[i] = rnd() % (fi->max_code + 1);
    for (int64_t i = 0; i < M * G; i++) sc[i] = (rnd() % 1000 + 1) * 1e-3f;
    if (ulb_pack_tiles(fmt, tiles, M, K, gs, codes, K, sc, blob, nb)) { printf("pack failed\n"); return 1; }
    ulb_weight w;
    ulb_weight_view(blob, nb, &w);
    const int64_t group = w.gsteps * ulb_tile_k(w.bits);

    int64_t ldx, incx;
    x_strides(layout, N, K, &ldx, &incx);
    const size_t xe = x_dt == ULB_DT_F32 ? 4 : 2, ye = y_dt == ULB_DT_F32 ? 4 : 2;
    const int64_t xlen = (N - 1) * ldx + (K - 1) * incx + 1, ldy = layout == X_CONTIG ? M : M + 5;
    /* xv: the values, fp32 (exact for bf16 too); xs: the strided buffer; xc: a contiguous copy. */
    float *xv = malloc(N * K * 4);
    char *xs = malloc(xlen * xe), *xc = malloc(N * K * xe);
    for (int64_t i = 0; i < xlen; i++) ulb_store_elem(xs, x_dt, i, NAN);
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            float v = layout == X_BROADCAST && n ? xv[k] : ((int)(rnd() % 2001) - 1000) * 1e-3f;
            if (x_dt == ULB_DT_BF16) v = ulb_bf16_to_f32(ulb_f32_to_bf16(v));
            xv[n * K + k] = v;
            ulb_store_elem(xs, x_dt, n * ldx + k * incx, v);
            ulb_store_elem(xc, x_dt, n * K + k, v);
        }
    void *bias = NULL;
    float *bv = calloc(M, 4);
    if (has_bias) {
        bias = malloc(M * (bias_dt == ULB_DT_F32 ? 4 : 2));
        for (int64_t m = 0; m < M; m++) {
            float v = ((int)(rnd() % 2001) - 1000) * 1e-3f;
            if (bias_dt == ULB_DT_BF16) v = ulb_bf16_to_f32(ulb_f32_to_bf16(v));
            bv[m] = v;
            ulb_store_elem(bias, bias_dt, m, v);
        }
    }
    char desc[200];
    snprintf(desc, sizeof desc, "fmt=%d M=%ld K=%ld gs=%ld N=%ld x=%s/%s(ldx=%ld incx=%ld) bias=%s y=%s(ldy=%ld)", fmt,
             (long)M, (long)K, (long)gs, (long)N, x_dt ? "bf16" : "f32", x_layout_name[layout], (long)ldx, (long)incx,
             !has_bias ? "none" : bias_dt ? "bf16" : "f32", y_dt ? "bf16" : "f32", (long)ldy);

    const size_t ybytes = (size_t)(N * ldy) * ye;
    /* y on a 64-byte boundary for some shapes, 32 bytes past one for the
     * others: one token streams whole aligned lines of y (ulb_out.stream). */
    const size_t yoff = (size_t)(M % 2) * 32;
    char *y[ULB_ISA_COUNT + 1], *ybase[ULB_ISA_COUNT + 1];
    int fails = 0;
    for (int isa = 0; isa <= ULB_ISA_COUNT; isa++) {
        ybase[isa] = aligned_alloc(64, (ybytes + YGUARD + yoff + 63) / 64 * 64);
        y[isa] = ybase[isa] + yoff;
        memset(y[isa], 0xa5, ybytes + YGUARD);
    }
    /* y[ULB_ISA_COUNT]: the scalar ISA on the contiguous copy */
    for (int run = 0; run <= ULB_ISA_COUNT && !fails; run++) {
        const int isa = run < ULB_ISA_COUNT ? run : 0;
        if (!ulb_isa_supported(isa)) continue;
        ulb_isa_set(isa);
        const int contig = run == ULB_ISA_COUNT;
        ulb_status st = ulb_linear(blob, nb, N, contig ? xc : xs, x_dt, contig ? K : ldx, contig ? 1 : incx, bias,
                                   bias_dt, y[run], y_dt, ldy, 2);
        if (st) { printf("linear failed %s: %s\n", ulb_status_str(st), desc); fails++; break; }
        for (int b = 0; b < YGUARD; b++)
            if ((unsigned char)y[run][ybytes + b] != 0xa5) { printf("WRITTEN PAST y %s: %s\n", desc, ulb_isa_name(isa)); fails++; break; }
        if (run && memcmp(y[0], y[run], ybytes)) {
            printf("MISMATCH %s: %s\n", desc, contig ? "scalar, this x vs a contiguous copy" : ulb_isa_name(isa));
            for (int64_t i = 0; i < N * ldy; i++)
                if (memcmp(y[0] + i * ye, y[run] + i * ye, ye)) {
                    printf("  first at n=%ld m=%ld: %g vs %g\n", (long)(i / ldy), (long)(i % ldy),
                           ulb_load_elem(y[0], y_dt, i), ulb_load_elem(y[run], y_dt, i));
                    break;
                }
            fails++;
        }
    }

    /* Reference: BitNet's quantisation in fp32 (ulb.h), then every product in double. */
    int8_t *q = malloc(K);
    for (int64_t n = 0; n < N && !fails; n++) {
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(xv[n * K + k]));
        const float inv = 127.0f / fmaxf(amax, 1e-5f), xscale = 1.0f / inv;
        for (int64_t k = 0; k < K; k++) q[k] = (int8_t)fminf(fmaxf(rintf(xv[n * K + k] * inv), -128.0f), 127.0f);
        for (int64_t m = 0; m < ldy && !fails; m++) {
            const int64_t i = n * ldy + m;
            if (m >= M) { /* padding of y: untouched */
                for (size_t b = 0; b < ye; b++)
                    if ((unsigned char)y[0][i * ye + b] != 0xa5) { printf("PADDING WRITTEN %s at n=%ld m=%ld\n", desc, (long)n, (long)m); fails++; break; }
                continue;
            }
            double want = 0.0, mag = 0.0;
            for (int64_t g = 0; g < G; g++) {
                int64_t dot = 0;
                for (int64_t k = g * group; k < (g + 1) * group && k < K; k++)
                    dot += (int64_t)(fi->level_a * codes[m * K + k] + fi->level_b) * q[k];
                want += (double)sc[m * G + g] * (double)dot;
                mag += fabs((double)sc[m * G + g] * (double)dot);
            }
            want = want * xscale + bv[m];
            mag = mag * xscale + fabs(bv[m]);
            const double got = ulb_load_elem(y[0], y_dt, i);
            const double tol = 1e-5 * mag + (y_dt == ULB_DT_BF16 ? 0x1p-8 * fabs(want) : 0.0) + 1e-30;
            if (!(fabs(got - want) <= tol)) {
                printf("REFERENCE MISMATCH %s at n=%ld m=%ld: %.9g vs %.9g\n", desc, (long)n, (long)m, got, want);
                fails++;
            }
        }
    }
    for (int isa = 0; isa <= ULB_ISA_COUNT; isa++) free(ybase[isa]);
    free(q); free(bias); free(bv); free(xv); free(xs); free(xc); free(codes); free(blob); free(sc);
    return fails;
}

/* check_linear over every (x dtype, y dtype, bias) on each shape, the x
 * layout turning with the shape so that every combination of the four comes up. */
static int check_linear_variants(int fmt, int tiles, int64_t M, int64_t K, int64_t gs, int64_t N, int *turn, int *n) {
    int fails = 0;
    for (int x_dt = 0; x_dt < 2; x_dt++)
        for (int y_dt = 0; y_dt < 2; y_dt++)
            for (int b = 0; b < 3; b++) {
                const int layout = (*turn)++ % X_LAYOUTS;
                fails += check_linear(fmt, tiles, M, K, gs, N, (ulb_dtype)x_dt, layout, b != 0,
                                      b == 2 ? ULB_DT_BF16 : ULB_DT_F32, (ulb_dtype)y_dt);
                (*n)++;
            }
    return fails;
}

#if defined(__x86_64__)
/* ulb_probe_sum_avx2 against a plain sum of the words, for every length
 * around its 8-word step and its runs' line multiples, from an unaligned
 * start, with and without prefetch, as one run and as several. */
static int check_probe_sum(int *n) {
    enum { WORDS = 5000 };
    uint64_t *buf = malloc((WORDS + 1) * 8);
    for (int64_t i = 0; i <= WORDS; i++) buf[i] = (uint64_t)rnd() << 40 ^ (uint64_t)rnd() << 20 ^ rnd();
    int fails = 0;
    const int64_t lengths[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 23, 24, 25, 63, 64, 65, WORDS - 1, WORDS};
    const int64_t dists[] = {0, 64, 4096};
    const int streams[] = {1, 2, 3, 4, ULB_PROBE_MAX_STREAMS};
    const int nlengths = (int)(sizeof lengths / sizeof *lengths), ndists = (int)(sizeof dists / sizeof *dists);
    const int nstreams = (int)(sizeof streams / sizeof *streams);
    for (int a = 0; a < nlengths; a++) for (int off = 0; off < 2; off++) for (int d = 0; d < ndists; d++)
        for (int s = 0; s < nstreams; s++) {
            uint64_t want = 0;
            for (int64_t i = 0; i < lengths[a]; i++) want += buf[off + i];
            (*n)++;
            if (ulb_probe_sum_avx2(buf + off, lengths[a], streams[s], dists[d]) != want) {
                printf("probe sum mismatch: %ld words from word %d, prefetch %ld, %d runs\n", (long)lengths[a], off,
                       (long)dists[d], streams[s]);
                fails++;
            }
        }
    free(buf);
    return fails;
}
#endif

/* ulb_read_probe_streams (whichever loop this CPU reads with) against a
 * plain sum of the whole words, over sizes around its 1 MiB chunks and 64 KiB
 * units (trailing bytes past the last whole word are not read), on one
 * thread and two; and its refusal of a stream count out of range. */
static int check_read_probe(int *n) {
    const int64_t words = (3 << 20) / 8 + 13;
    uint64_t *buf = malloc(words * 8);
    for (int64_t i = 0; i < words; i++) buf[i] = (uint64_t)rnd() << 40 ^ (uint64_t)rnd() << 20 ^ rnd();
    const int64_t sizes[] = {0, 5, 8, 8 * 41 + 3, 64 << 10, (1 << 20) - 8, (1 << 20) + 8 * 9 + 7, words * 8};
    int fails = 0;
    for (int z = 0; z < (int)(sizeof sizes / sizeof *sizes); z++) {
        uint64_t want = 0;
        for (int64_t i = 0; i < sizes[z] / 8; i++) want += buf[i];
        for (int s = 1; s <= ULB_PROBE_MAX_STREAMS; s++) for (int t = 1; t <= 2; t++) {
            uint64_t got = 0;
            (*n)++;
            if (ulb_read_probe_streams((const uint8_t *)buf, sizes[z], t, s, &got) != ULB_OK || got != want) {
                printf("read probe mismatch: %ld bytes, %d runs, %d threads\n", (long)sizes[z], s, t);
                fails++;
            }
        }
    }
    const int bad[] = {0, -1, ULB_PROBE_MAX_STREAMS + 1};
    for (int b = 0; b < 3; b++) {
        (*n)++;
        if (ulb_read_probe_streams((const uint8_t *)buf, 64, 1, bad[b], NULL) != ULB_ERR_SHAPE) {
            printf("read probe took %d runs\n", bad[b]);
            fails++;
        }
    }
    free(buf);
    return fails;
}

/* The tile order: LANES for 1-bit formats only, a blob naming another order
 * rejected, the preferred order of the active ISA, and the same bytes placed
 * as ulb_tile_byte says. */
static int check_tile_orders(int *n) {
    int fails = 0;
    const int64_t M = 16, K = 32;
    uint8_t codes[16 * 32] = {0}, *blob = malloc(ulb_packed_nbytes(ULB_FMT_BINARY, M, K, 0));
    float sc[16];
    for (int i = 0; i < 16; i++) sc[i] = 1.0f;
    const int64_t nb = ulb_packed_nbytes(ULB_FMT_BINARY, M, K, 0);
    fails += ulb_pack_tiles(ULB_FMT_TERNARY, ULB_TILES_LANES, M, K, 0, codes, K, sc, blob, nb) != ULB_ERR_TILES;
    fails += ulb_pack_tiles(ULB_FMT_BINARY, ULB_TILES_COUNT, M, K, 0, codes, K, sc, blob, nb) != ULB_ERR_TILES;
    codes[5 * K + 9] = 1; /* row 5, column 9: byte slot 1, field 2 */
    for (int tiles = 0; tiles < 2; tiles++) {
        fails += ulb_pack_tiles(ULB_FMT_BINARY, tiles, M, K, 0, codes, K, sc, blob, nb) != ULB_OK;
        const uint8_t *tile = blob + ULB_HEADER_BYTES + ULB_TILE_SCALE_BYTES;
        for (int i = 0; i < ULB_TILE_BYTES; i++)
            if (tile[i] != (i == (tiles ? 16 * 1 + 5 : 4 * 5 + 1) ? 1 << 2 : 0)) {
                printf("tiles %d: byte %d holds %d\n", tiles, i, tile[i]);
                fails++;
            }
        ulb_header h;
        fails += ulb_blob_header(blob, nb, &h) != ULB_OK || h.tiles != tiles || h.format != ULB_FMT_BINARY;
    }
    blob[7] = ULB_TILES_COUNT; /* the header's tile order */
    fails += ulb_blob_header(blob, nb, &(ulb_header){0}) != ULB_ERR_BLOB;
    blob[7] = 1, blob[6] = ULB_FMT_INT2;
    fails += ulb_blob_header(blob, nb, &(ulb_header){0}) != ULB_ERR_BLOB;
    /* ulb_retile: the blob ulb_pack_tiles makes in the other order, both ways, groups and partial panels. */
    {
        const int64_t M2 = 70, K2 = 100, gs = 64, nb2 = ulb_packed_nbytes(ULB_FMT_BINARY, M2, K2, gs);
        uint8_t *c2 = malloc(M2 * K2), *in[2] = {malloc(nb2), malloc(nb2)}, *got = malloc(nb2);
        float sc2[70 * 2];
        for (int64_t i = 0; i < M2 * K2; i++) c2[i] = rnd() & 1;
        for (int i = 0; i < 70 * 2; i++) sc2[i] = (float)(i + 1);
        for (int tiles = 0; tiles < 2; tiles++)
            fails += ulb_pack_tiles(ULB_FMT_BINARY, tiles, M2, K2, gs, c2, K2, sc2, in[tiles], nb2) != ULB_OK;
        for (int from = 0; from < 2; from++)
            for (int to = 0; to < 2; to++) {
                memset(got, 0xa5, nb2);
                fails += ulb_retile(in[from], nb2, to, got) != ULB_OK || memcmp(got, in[to], nb2) != 0;
            }
        fails += ulb_retile(in[0], nb2, ULB_TILES_LANES, in[0] + 64) != ULB_ERR_SHAPE; /* overlapping */
        fails += ulb_retile(in[0], nb2, ULB_TILES_COUNT, got) != ULB_ERR_TILES;
        const int64_t nb4 = ulb_packed_nbytes(ULB_FMT_INT2, M, K, 0);
        uint8_t *i2 = malloc(nb4), *o2 = malloc(nb4);
        fails += ulb_pack(ULB_FMT_INT2, M, K, 0, codes, K, sc, i2, nb4) != ULB_OK;
        fails += ulb_retile(i2, nb4, ULB_TILES_LANES, o2) != ULB_ERR_TILES;
        fails += ulb_retile(i2, nb4, ULB_TILES_PREFERRED, o2) != ULB_OK || memcmp(i2, o2, nb4) != 0;
        free(c2); free(in[0]); free(in[1]); free(got); free(i2); free(o2);
    }
    const ulb_isa was = ulb_isa_active();
    for (int isa = 0; isa < ULB_ISA_COUNT; isa++) {
        if (!ulb_isa_supported(isa)) continue;
        ulb_isa_set(isa);
        const int lanes = isa == ULB_ISA_AVX2 || isa == ULB_ISA_AVXVNNI;
        fails += ulb_tiles_preferred(ULB_FMT_BINARY) != (lanes ? ULB_TILES_LANES : ULB_TILES_VNNI);
        fails += ulb_tiles_preferred(ULB_FMT_INT2) != ULB_TILES_VNNI;
    }
    ulb_isa_set(was);
    if (fails) printf("tile orders: %d failures\n", fails);
    free(blob);
    (*n)++;
    return fails != 0;
}

/* KMAJOR, the accelerator layout, for every format: a code and a scale where
 * ulb.h says, ulb_retile to and from it giving what ulb_pack_tiles gives,
 * ulb_unpack reading it back, and the CPU kernels refusing it. */
static int check_kmajor(int *n) {
    int fails = 0;
    const int64_t M = 21, K = 200;
    for (int i = 0; i < ulb_format_count(); i++) {
        const ulb_format_info *fi = ulb_format_at(i);
        if (!(fi->tiles >> ULB_TILES_KMAJOR & 1)) { /* base 3: refused by name */
            const int64_t nb = ulb_packed_nbytes(fi->id, M, K, 0);
            uint8_t *codes = calloc(M * K, 1), *blob = malloc(nb);
            float *sc = calloc(M, sizeof(float));
            fails += ulb_pack_tiles(fi->id, ULB_TILES_KMAJOR, M, K, 0, codes, K, sc, blob, nb) != ULB_ERR_TILES;
            free(codes); free(blob); free(sc);
            (*n)++;
            continue;
        }
        const int64_t gs = fi->tile_k * 2, nb = ulb_packed_nbytes(fi->id, M, K, gs);
        const int64_t G = (ulb_round_up(K, fi->tile_k) + gs - 1) / gs;
        uint8_t *codes = malloc(M * K), *back = malloc(M * K), *blob[2] = {malloc(nb), malloc(nb)}, *got = malloc(nb);
        float *sc = malloc(M * G * sizeof(float)), *sc_back = malloc(M * G * sizeof(float)), y[21];
        for (int64_t j = 0; j < M * K; j++) codes[j] = (uint8_t)(rnd() % (fi->max_code + 1));
        for (int64_t j = 0; j < M * G; j++) sc[j] = (float)(j + 1);
        fails += ulb_pack_tiles(fi->id, ULB_TILES_KMAJOR, M, K, gs, codes, K, sc, blob[1], nb) != ULB_OK;
        fails += ulb_pack_tiles(fi->id, ULB_TILES_VNNI, M, K, gs, codes, K, sc, blob[0], nb) != ULB_OK;
        /* code (m, k) = (5, 37): field 37 % tile_k of word (37 / tile_k, 5); scale (5, 1) after 1 * M_pad. */
        const int64_t M_pad = 32, tk = fi->tile_k;
        uint32_t word;
        float s;
        memcpy(&word, blob[1] + ULB_HEADER_BYTES + G * M_pad * 4 + ((37 / tk) * M_pad + 5) * 4, 4);
        fails += (word >> (37 % tk * fi->bits) & ((1u << fi->bits) - 1)) != codes[5 * K + 37];
        memcpy(&s, blob[1] + ULB_HEADER_BYTES + (1 * M_pad + 5) * 4, 4);
        fails += G > 1 && s != sc[5 * G + 1];
        for (int from = 0; from < 2; from++) {
            memset(got, 0xa5, nb);
            fails += ulb_retile(blob[from], nb, from ? ULB_TILES_VNNI : ULB_TILES_KMAJOR, got) != ULB_OK ||
                     memcmp(got, blob[1 - from], nb) != 0;
        }
        fails += ulb_unpack(blob[1], nb, back, sc_back) != ULB_OK || memcmp(back, codes, M * K) != 0 ||
                 memcmp(sc_back, sc, M * G * sizeof(float)) != 0;
        float x[200] = {1.0f};
        fails += ulb_linear(blob[1], nb, 1, x, ULB_DT_F32, K, 1, NULL, ULB_DT_F32, y, ULB_DT_F32, M, 1) !=
                 ULB_ERR_LAYOUT;
        if (fails) printf("kmajor %s: %d failures\n", fi->name, fails);
        free(codes); free(back); free(blob[0]); free(blob[1]); free(got); free(sc); free(sc_back);
        (*n)++;
        if (fails) return 1;
    }
    return 0;
}

#if defined(__x86_64__)
/* The AVX2 builder of the LANES lookup tables against plain C, byte for
 * byte, over every activation value. */
static int check_lanes_tables(int *n) {
    enum { KSTEPS = 9 };
    int8_t x[32 * KSTEPS];
    uint8_t want[KSTEPS * ULB_LUT1_STEP_BYTES], got[KSTEPS * ULB_LUT1_STEP_BYTES];
    for (int i = 0; i < 32 * KSTEPS; i++) x[i] = (int8_t)(i < 256 ? i - 128 : (int)(rnd() % 256) - 128);
    ulb_lut1_lanes_build_ref(x, KSTEPS, want);
    ulb_lut1_lanes_build_avx2(x, KSTEPS, got);
    (*n)++;
    if (memcmp(want, got, sizeof want)) return printf("LANES tables differ from plain C\n"), 1;
    return 0;
}
#endif

/* ulb_linear_many against ulb_linear on each layer, to the bit, under every
 * ISA, on one and two threads: layers of different shapes, groups and token
 * counts (none too), biased or not, fp32 and bf16, padded output rows left
 * alone; and the decode case, one token through eight equal layers. A bad
 * blob or count fails the call before anything is written. */
#define MANY_LAYERS 8
static int check_linear_many(int fmt, int tiles, int decode, ulb_dtype dt, int *n) {
    const ulb_format_info *fi = ulb_format_get(fmt);
    static const int64_t shapes[MANY_LAYERS][4] = {/* M, K, group size, N */
        {7, 33, 0, 1}, {100, 257, 32, 0}, {333, 1100, 128, 3}, {64, 2048, 0, 2},
        {70, 4097, 32, 17}, {1, 16, 0, 1}, {129, 96, 32, 5}, {200, 520, 0, 1}};
    ulb_linear_args layers[MANY_LAYERS];
    int64_t ybytes[MANY_LAYERS];
    uint8_t *blobs[MANY_LAYERS];
    char *want[MANY_LAYERS], *got[MANY_LAYERS];
    void *xs[MANY_LAYERS], *bias[MANY_LAYERS];
    const size_t e = dt == ULB_DT_F32 ? 4 : 2;
    int fails = 0;
    for (int i = 0; i < MANY_LAYERS; i++) {
        const int64_t M = decode ? 192 : shapes[i][0], K = decode ? 256 : shapes[i][1];
        const int64_t gs = fit_gs(fi, decode ? 32 : shapes[i][2]), N = decode ? 1 : shapes[i][3];
        const int64_t G = gs <= 0 || gs >= K ? 1 : (K + gs - 1) / gs, nb = ulb_packed_nbytes(fmt, M, K, gs);
        uint8_t *codes = malloc(M * K);
        float *sc = malloc(M * G * 4);
        for (int64_t j = 0; j < M * K; j++) codes[j] = rnd() % (fi->max_code + 1);
        for (int64_t j = 0; j < M * G; j++) sc[j] = (rnd() % 1000 + 1) * 1e-3f;
        blobs[i] = malloc(nb);
        if (ulb_pack_tiles(fmt, tiles, M, K, gs, codes, K, sc, blobs[i], nb)) { printf("pack failed\n"); return 1; }
        free(codes); free(sc);
        xs[i] = malloc((N ? N : 1) * K * e);
        for (int64_t j = 0; j < N * K; j++) ulb_store_elem(xs[i], dt, j, ((int)(rnd() % 2001) - 1000) * 1e-3f);
        bias[i] = NULL;
        if (i % 3 != 1) {
            bias[i] = malloc(M * e);
            for (int64_t m = 0; m < M; m++) ulb_store_elem(bias[i], dt, m, ((int)(rnd() % 2001) - 1000) * 1e-3f);
        }
        const int64_t ldy = M + (i % 2) * 3;
        ybytes[i] = (N ? N : 1) * ldy * (int64_t)e;
        want[i] = malloc(ybytes[i]);
        got[i] = malloc(ybytes[i]);
        layers[i] = (ulb_linear_args){blobs[i], nb, N, decode && i ? xs[0] : xs[i], K, 1, bias[i], NULL, ldy};
    }
    for (int isa = 0; isa < ULB_ISA_COUNT; isa++) {
        if (!ulb_isa_supported(isa)) continue;
        ulb_isa_set(isa);
        for (int i = 0; i < MANY_LAYERS; i++) {
            const ulb_linear_args *a = &layers[i];
            memset(want[i], 0x7f, ybytes[i]);
            if (ulb_linear(a->blob, a->nbytes, a->N, a->x, dt, a->ldx, a->incx, a->bias, dt, want[i], dt, a->ldy, 1)) {
                printf("linear failed\n");
                return 1;
            }
        }
        for (int threads = 1; threads <= 2; threads++, (*n)++) {
            for (int i = 0; i < MANY_LAYERS; i++) {
                memset(got[i], 0x7f, ybytes[i]);
                layers[i].y = got[i];
            }
            const ulb_status st = ulb_linear_many(layers, MANY_LAYERS, dt, dt, dt, threads);
            for (int i = 0; i < MANY_LAYERS; i++)
                if (st != ULB_OK || memcmp(want[i], got[i], ybytes[i])) {
                    printf("LINEAR_MANY MISMATCH fmt=%d tiles=%d decode=%d dt=%d isa=%s threads=%d layer %d (%s)\n",
                           fmt, tiles, decode, dt, ulb_isa_name(isa), threads, i, ulb_status_str(st));
                    fails++;
                    break;
                }
        }
    }
    /* Refused before any output is written: a blob with a bad header in the
     * last layer, a negative count, an output row shorter than M. */
    for (int i = 0; i < MANY_LAYERS; i++) memset(got[i], 0x7f, ybytes[i]);
    const uint8_t saved = blobs[MANY_LAYERS - 1][0];
    blobs[MANY_LAYERS - 1][0] ^= 0xff;
    fails += ulb_linear_many(layers, MANY_LAYERS, dt, dt, dt, 2) == ULB_OK;
    blobs[MANY_LAYERS - 1][0] = saved;
    layers[MANY_LAYERS - 1].ldy = 0;
    fails += ulb_linear_many(layers, MANY_LAYERS, dt, dt, dt, 2) != ULB_ERR_SHAPE;
    fails += ulb_linear_many(layers, -1, dt, dt, dt, 2) != ULB_ERR_SHAPE;
    fails += ulb_linear_many(layers, 0, dt, dt, dt, 2) != ULB_OK;
    for (int i = 0; i < MANY_LAYERS; i++) {
        char *untouched = malloc(ybytes[i]);
        memset(untouched, 0x7f, ybytes[i]);
        if (memcmp(got[i], untouched, ybytes[i])) { printf("linear_many wrote on a refused call\n"); fails++; }
        free(untouched);
        free(blobs[i]); free(xs[i]); free(bias[i]); free(want[i]); free(got[i]);
    }
    (*n) += 4;
    return fails;
}

/* ULB_TEST_FEW_SHAPES=1: a sample of the shapes below, for the runs under
 * emulation on CPU models whose kernels a full run on another model has
 * covered, which check what the HWCAPs offer there (tests/test_c_kernels.py). */
int main(void) {
    const char *few_env = getenv("ULB_TEST_FEW_SHAPES");
    const int few = few_env && !strcmp(few_env, "1");
    int fails = 0, n = 0;
    fails += forms_init(&n);
    /* The lookup kernels wherever they run, not only where "auto" takes them. */
    if (ulb_lut1_set(2) != ULB_ERR_SHAPE) { printf("ulb_lut1_set took mode 2\n"); fails++; }
    ulb_lut1_set(ULB_LUT1_ON);
    const int64_t Ms[] = {1, 7, 33, 100, 1000};
    const int64_t Ks[] = {1, 16, 33, 257, 4097};
    const int64_t Ns[] = {1, 2, 4, 5, 9}; /* 4: lookups for four tokens; 5, 9: not */
    const int64_t gss[] = {0, 32, 128};
    for (int f = 0; f < N_FORMS; f++)
        for (int a = 0; a < 5; a++)
        for (int b = 0; b < 5; b++)
        for (int c = 0; c < 5; c++)
        for (int d = 0; d < 3; d++) {
            if (Ms[a] * Ks[b] > 1000 * 300 && c > 2) continue;
            if (few && (a % 2 == 0 || b % 2 || b == 0 || c == 4 || d == 2)) continue;
            fails += check(FORMS[f].fmt, FORMS[f].tiles, Ms[a], Ks[b], gss[d], Ns[c]);
            n++;
        }
    for (int a = 0; a < 5; a++) for (int b = 0; b < 5; b++) {
        if (few && (a + b) % 3) continue;
        fails += check_bf16(Ms[a], Ks[b], Ks[b] + (a % 2) * 5, 1 + b % 2);
        n++;
    }
    /* K a multiple of the 32-column chunk (no tail, as every lm_head), a tail
     * in accumulator set 3, and no columns at all. */
    const int64_t bf16_Ks[4] = {32, 100, 2048, 0};
    for (int b = 0; b < 4; b++) {
        fails += check_bf16(67, bf16_Ks[b], bf16_Ks[b] + 3 * (b % 2), 1 + (b == 3));
        n++;
    }
    /* Blocks of 64 rows and of 6 (4 in lockstep and 2 alone in the AVX2 kernel,
     * 2 x 3 in the AVX-512 one that reads two rows at once). */
    for (int b = 0; b < 5; b++) {
        fails += check_bf16(70, Ks[b], Ks[b] + 3, 1);
        n++;
    }
    /* Prefill sizes, which the AMX GEMM takes from 16 tokens on, 128 a call in
     * tiles of 16: one tile, a tile and one token, two and a partial one, a
     * full call and a partial second; per-channel groups (K = 4097: 65
     * k-blocks, in chunks of 8, the last partial), groups of 32 (half a
     * k-block) and 128 (two). */
    const int64_t gemm_Ns[] = {16, 17, 37, 150};
    for (int f = 0; f < N_FORMS; f++)
        for (int a = 1; a < 5; a++)
        for (int b = 1; b < 5; b++)
        for (int c = 0; c < 4; c++)
        for (int d = 0; d < 3; d++) {
            if (Ms[a] * Ks[b] > 1000 * 300 && (c != 1 || d != 2)) continue;
            if (few && (a != 3 || b != 3 || c != 1)) continue;
            fails += check(FORMS[f].fmt, FORMS[f].tiles, Ms[a], Ks[b], gss[d], gemm_Ns[c]);
            n++;
        }
    /* Where the AMX GEMM's paths branch: panels of 2 and 4 tiles (M = 90,
     * 100) over several chunks (K = 4097 per channel), and groups of 96
     * (two k-blocks, the second partial, in every group). */
    for (int f = 0; f < N_FORMS && !few; f++)
        for (int a = 0; a < 2; a++)
            for (int c = 0; c < 2; c++) {
                const int64_t M = a ? 100 : 90, N = c ? 37 : 17;
                fails += check(FORMS[f].fmt, FORMS[f].tiles, M, 1100, 96, N);
                fails += check(FORMS[f].fmt, FORMS[f].tiles, M, c ? 1100 : 4097, 0, N);
                n += 2;
            }
    /* int8 and int4 groups narrower than the 2-bit tile (and than 16 bytes,
     * the AMX GEMM's narrowest k-block) */
    const int64_t narrow_Ns[] = {1, 2, 4, 5, 37};
    for (int a = 1; a < 4; a++) for (int c = 0; c < 5; c++) {
        if (few && (a != 3 || c % 2)) continue;
        fails += check(ULB_FMT_INT8, ULB_TILES_VNNI, Ms[a], 257, 12, narrow_Ns[c]);
        fails += check(ULB_FMT_INT4, ULB_TILES_VNNI, Ms[a], 257, 24, narrow_Ns[c]);
        n += 2;
    }
    /* Calls whose last kernel call takes 2 or 3 tokens, on either side of
     * the AVX-512 kernels' switch to per-slot sums (tokens_group_slots: 1-bit
     * codes from 2 tokens, 2-bit from 4). */
    const int64_t tail_Ns[] = {3, 6, 7};
    for (int f = 0; f < N_FORMS; f++)
        for (int c = 0; c < 3 && (!few || c == 0); c++) {
            fails += check(FORMS[f].fmt, FORMS[f].tiles, 100, 257, 32, tail_Ns[c]);
            fails += check(FORMS[f].fmt, FORMS[f].tiles, 33, 4097, 0, tail_Ns[c]);
            n += 2;
        }
    const int64_t extreme_Ns[] = {1, 2, 3, 7, 16};
    for (int f = 0; f < N_FORMS; f++)
        for (int c = 0; c < 5; c++) {
            if (few && c != 0) continue;
            fails += check_int_extremes(FORMS[f].fmt, FORMS[f].tiles, 65536, extreme_Ns[c]);
            n++;
        }
    /* ulb_linear's dtypes, bias and strides: M and K off the 64-row panel and
     * the tiles, one and two groups, N = 1 (its own output path) and N > 1 (a
     * partial block of ULB_NB_MAX tokens); the larger shape runs on two threads. */
    int turn = 0;
    const int64_t lin_MK[][2] = {{7, 33}, {100, 257}, {333, 1100}};
    const int64_t lin_Ns[] = {1, 2, 5, 18};
    for (int f = 0; f < N_FORMS; f++)
        for (int a = 0; a < 3; a++)
            for (int c = 0; c < 4; c++)
                for (int d = 0; d < 2; d++) {
                    if (a == 2 && (c == 1 || c == 3 || d == 1)) continue;
                    if (few && (a != 1 || c % 2 || d)) continue;
                    fails += check_linear_variants(FORMS[f].fmt, FORMS[f].tiles, lin_MK[a][0], lin_MK[a][1], gss[d],
                                                   lin_Ns[c], &turn, &n);
                }
    /* One token over more panels per thread (20 on each of two threads, so
     * ten pairs under AVX2) than the output ring of 2-8-bit codes holds, y
     * 64-byte aligned (M even) and not. */
    for (int f = 0; f < N_FORMS; f++)
        for (int64_t M = few ? 2601 : 2600; M <= 2601; M++)
            for (int y_dt = few; y_dt < 2; y_dt++, n++)
                fails += check_linear(FORMS[f].fmt, FORMS[f].tiles, M, 1030, 0, 1, ULB_DT_BF16, X_CONTIG, 1,
                                      ULB_DT_F32, (ulb_dtype)y_dt);
    /* 1-bit codes through the masking kernels too, for calls the lookups
     * take whenever they can (ULB_LUT1_ON above). */
    ulb_lut1_set(ULB_LUT1_OFF);
    for (int f = 0; f < N_FORMS; f++)
        if (ulb_format_get(FORMS[f].fmt)->bits == 1)
            for (int c = 0; c < 3; c++) {
                fails += check(FORMS[f].fmt, FORMS[f].tiles, 100, 257, 32, Ns[c]);
                fails += check(FORMS[f].fmt, FORMS[f].tiles, 33, 4097, 0, Ns[c]);
                n += 2;
            }
    ulb_lut1_set(ULB_LUT1_ON);
    for (int f = 0; f < N_FORMS; f++)
        for (int decode = few; decode < 2; decode++)
            fails += check_linear_many(FORMS[f].fmt, FORMS[f].tiles, decode, (ulb_dtype)((f + decode) % 2), &n);
    fails += check_tile_orders(&n);
    fails += check_kmajor(&n);
#if defined(__x86_64__)
    if (ulb_isa_supported(ULB_ISA_AVX2)) fails += check_probe_sum(&n) + check_lanes_tables(&n);
#endif
    fails += check_read_probe(&n);
    printf("ISAs run:");
    for (int isa = 0; isa < ULB_ISA_COUNT; isa++)
        if (ulb_isa_supported(isa)) printf(" %s", ulb_isa_name(isa));
    printf("\nbest ISA: %s\n%d passed, %d failed\n", ulb_isa_name(ulb_isa_best()), n - fails, fails);
    return fails != 0;
}
