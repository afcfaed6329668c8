/* The linear driver: split panels over threads, quantise the activations
 * inside that parallel region, and on each panel run the active ISA's
 * microkernel and output step (activation scale, bias, output dtype). */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void *ulb_aligned_alloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) return NULL;
    return p;
}

void ulb_aligned_free(void *p) { free(p); }

typedef struct {
    void *scratch; /* one allocation holding the arrays below */
    int8_t *xq;
    float *xscale;
    int32_t *xsum;
    ulb_lut1_build_fn lut1_build; /* fills acts.lut1, or NULL: no tables */
    float *facc1; /* one token without the output ring: M_pad results (one_token_panels) */
    ulb_acts acts;
} quantized_acts;

static void acts_free(quantized_acts *q) { ulb_aligned_free(q->scratch); }

/* The table builder if a call takes a 1-bit lookup kernel (ulb_lut1_serves),
 * else NULL: no tables. */
static ulb_lut1_build_fn use_lut1(const ulb_weight *w, int64_t N, int nthreads, ulb_isa isa) {
    return ulb_lut1_serves(w->tiles, N, nthreads, isa) ? ulb_lut1_builder_for(w, isa) : NULL;
}

/* Whether a call reads two panels at once where the ISA has a pair kernel:
 * one token, and panels long enough (from 16 KiB; the 1-bit lookups on
 * several threads from 32 KiB): on shorter panels pairs cost more than they
 * gain (benchmarks/c/ab_builds.sh). Per-channel int4 under the AVX2 kernels
 * on Intel (the only pair kernel for int4; the AVX-512 ones read one panel
 * at a time anyway) streams better one panel at a time, so no pairs there.
 * (Not run by this machine's tests: covered on AMD.) */
#define PAIR_MIN_PANEL_BYTES (16 << 10)
static int use_pairs(const ulb_weight *w, int64_t N, int nthreads) {
    const int64_t panel = ulb_panel_offset(w->ksteps, w->n_groups, 1);
    if (w->bits == 4 && w->n_groups == 1 && ulb_cpu_intel()) return 0;
    return N == 1 && panel >= PAIR_MIN_PANEL_BYTES &&
           (w->bits != 1 || nthreads == 1 || panel >= 2 * PAIR_MIN_PANEL_BYTES);
}

/* Whether a one-token call on w sends its results through the output ring
 * (one_token_panels) rather than an M-float buffer: not for 1-bit codes,
 * whose lookup kernel ran slower with it (benchmarks/c/ab_builds.sh). */
static int ring_output(const ulb_weight *w) { return w->bits != 1; }

/* Bytes of int8 activations to allocate for N tokens: a GEMM kernel reads
 * whole tiles of tokens, and a little past the last (ulb_gemm_kernel). */
static int64_t xq_bytes_for(const ulb_weight *w, int64_t N, const ulb_gemm_kernel *gemm) {
    return gemm ? ulb_round_up(N, gemm->tile_tokens) * w->K_pad + gemm->xq_slack : N * w->K_pad;
}

/* Scratch for the int8 activations of N tokens, and with lut1_build the
 * lookup tables of the 1-bit one-token kernel; filled by acts_fill. */
static ulb_status acts_alloc(const ulb_weight *w, ulb_lut1_build_fn lut1_build, const ulb_gemm_kernel *gemm,
                             int nthreads, int64_t N, quantized_acts *q) {
    const int lut = lut1_build != NULL;
    const int64_t pad_from = N * w->K_pad, pad_to = xq_bytes_for(w, N, gemm);
    const size_t xq_bytes = (size_t)ulb_round_up(pad_to, 64);
    const size_t xs_bytes = (size_t)ulb_round_up(N * (int64_t)sizeof(float), 64);
    const size_t sum_bytes = (size_t)ulb_round_up(N * w->n_groups * (int64_t)sizeof(int32_t), 64);
    const size_t lut_bytes = lut ? (size_t)(N * w->ksteps * ULB_LUT1_STEP_BYTES) : 0;
    const size_t facc1_bytes = N == 1 && !ring_output(w) ? (size_t)w->M_pad * sizeof(float) : 0;
    memset(q, 0, sizeof *q);
    q->scratch = ulb_aligned_alloc(xq_bytes + xs_bytes + sum_bytes + lut_bytes + facc1_bytes);
    if (!q->scratch) return ULB_ERR_NOMEM;
    q->xq = q->scratch;
    memset(q->xq + pad_from, 0, (size_t)(pad_to - pad_from));
    q->xscale = (float *)((char *)q->scratch + xq_bytes);
    q->xsum = (int32_t *)((char *)q->scratch + xq_bytes + xs_bytes);
    q->lut1_build = lut1_build;
    if (facc1_bytes) q->facc1 = (float *)((char *)q->scratch + xq_bytes + xs_bytes + sum_bytes + lut_bytes);
    const uint8_t *lut1 = lut ? (uint8_t *)q->scratch + xq_bytes + xs_bytes + sum_bytes : NULL;
    q->acts = ulb_acts_of(w, N, q->xq, q->xsum, lut1, nthreads);
    return ULB_OK;
}

typedef struct {
    const void *x;
    ulb_dtype dt;
    int64_t ldx, incx;
} act_input;

/* Quantises rows [r0, r1) of x, and builds their 1-bit tables where the
 * call has them. */
static ulb_status acts_fill(const ulb_weight *w, int64_t r0, int64_t r1, const act_input *in, quantized_acts *q) {
    const size_t esize = in->dt == ULB_DT_F32 ? 4 : 2;
    const ulb_status st = ulb_quantize_act(r1 - r0, w->K, w->K_pad, w->gsteps * ulb_tile_k(w->bits),
                                           (const char *)in->x + (size_t)(r0 * in->ldx) * esize, in->dt, in->ldx,
                                           in->incx, q->xq + r0 * w->K_pad, q->xscale + r0,
                                           q->xsum + r0 * w->n_groups);
    for (int64_t r = r0; st == ULB_OK && q->acts.lut1 && r < r1; r++)
        q->lut1_build(q->xq + r * w->K_pad, w->ksteps, (uint8_t *)q->acts.lut1 + r * w->ksteps * ULB_LUT1_STEP_BYTES);
    return st;
}

typedef struct {
    const ulb_weight *w;
    quantized_acts *q;
    act_input in;
    int64_t N;
    int64_t acts_claim;              /* rows of x a thread quantises at a time */
    _Atomic int64_t acts_next;       /* first row not yet claimed */
    _Atomic int64_t acts_done;       /* rows quantised */
    _Atomic int acts_status;         /* a ulb_status; the last failure wins */
    int warm_first;                  /* prefetch before quantising (see acts_ready) */
    ulb_panel_fn panel;
    ulb_panel_pair_fn pair; /* one token: two panels at once, or NULL */
    const ulb_gemm_kernel *gemm; /* many tokens: the ISA's GEMM kernel, or NULL */
    ulb_store_fn store;
    ulb_out out;
} linear_job;

/* Bytes at the start of its panels that each thread prefetches before it
 * quantises or waits for the activations (-D to try others). */
#ifndef ULB_WARM_BYTES
#define ULB_WARM_BYTES 8192
#endif

/* The activations are quantised inside the parallel region: every thread
 * prefetches the start of its panels, claims rows of x to quantise until
 * none are left, and waits for the rows others claimed. So
 * the weight streams start while the activations are quantised, instead of
 * after it and after the fork, and a prefill's rows are quantised by every
 * thread. A thread waits only once every row is claimed by a thread already
 * at work, so it cannot deadlock. Against quantising before the fork it
 * gains on small matrices and is unchanged on large ones, but only with the
 * prefetch of ULB_WARM_BYTES (benchmarks/c/ab_builds.sh). */
static void warm(const uint8_t *first, const uint8_t *end) {
    for (int64_t o = 0; o < ULB_WARM_BYTES && o < end - first; o += 64) __builtin_prefetch(first + o, 0, 2);
}

/* A thread alone prefetches before it quantises, so that its stream starts
 * under the quantisation (and the 1-bit tables). With other threads waiting
 * for the activations, a thread quantises first: its loads of x would queue
 * behind its own prefetches, and the others wait for them. */
static int acts_ready(linear_job *job, const uint8_t *first, const uint8_t *end) {
    if (job->warm_first) warm(first, end);
    for (;;) {
        const int64_t r0 = atomic_fetch_add_explicit(&job->acts_next, job->acts_claim, memory_order_relaxed);
        if (r0 >= job->N) break;
        const int64_t r1 = r0 + job->acts_claim < job->N ? r0 + job->acts_claim : job->N;
        const ulb_status st = acts_fill(job->w, r0, r1, &job->in, job->q);
        if (st != ULB_OK) atomic_store_explicit(&job->acts_status, st, memory_order_relaxed);
        /* Release: whoever reads the final count sees every claimed row's bytes. */
        atomic_fetch_add_explicit(&job->acts_done, r1 - r0, memory_order_release);
        /* Claiming past the end would pull the line the waiters spin on back
         * across cores. */
        if (r1 == job->N) break;
    }
    if (!job->warm_first) warm(first, end);
    ulb_spin_wait spin = ulb_spin_start();
    while (atomic_load_explicit(&job->acts_done, memory_order_acquire) < job->N) ulb_spin_step(&spin);
    return atomic_load_explicit(&job->acts_status, memory_order_relaxed) == ULB_OK;
}

/* Rows of panels [p0, p1): [m0, m0 + rows). */
static int64_t panel_rows(const ulb_weight *w, int64_t p0, int64_t p1, int64_t *m0) {
    *m0 = p0 * ULB_PANEL_ROWS;
    const int64_t m1 = p1 * ULB_PANEL_ROWS < w->M ? p1 * ULB_PANEL_ROWS : w->M;
    return m1 - *m0;
}

/* The calling thread's panels through the GEMM kernel, a block of tokens at
 * a time, every panel for one block before the next: a block's activations
 * (128 x K bytes under AMX) then stay in L2 while the codes, a quarter as
 * many bytes per column of a panel or fewer, are read again for each block. */
static void gemm_panels(linear_job *job, const ulb_acts *acts, int64_t p0, int64_t p1) {
    const ulb_weight *w = job->w;
    const ulb_gemm_kernel *k = job->gemm;
    const size_t facc_bytes = (size_t)k->tokens * ULB_PANEL_ROWS * sizeof(float);
    float *facc = ulb_aligned_alloc(facc_bytes + (size_t)k->scratch_bytes(w));
    if (!facc) {
        atomic_store_explicit(&job->acts_status, ULB_ERR_NOMEM, memory_order_relaxed);
        return;
    }
    k->begin(w);
    for (int64_t n0 = 0; n0 < job->N; n0 += k->tokens) {
        const int nb = job->N - n0 < k->tokens ? (int)(job->N - n0) : k->tokens;
        for (int64_t p = p0; p < p1; p++) {
            int64_t m0;
            const int64_t rows = panel_rows(w, p, p + 1, &m0);
            k->panel(w, p, acts, n0, nb, (uint8_t *)facc + facc_bytes, facc, NULL);
            job->store(&job->out, facc, n0, nb, m0, rows);
        }
    }
    k->end();
    ulb_aligned_free(facc);
}

/* One token: each thread's results of RING_PANELS panels at a time wait in
 * a ring on its stack for the output step, which streams them to y
 * (ulb_out.stream), where ring_output says so. Results written to an
 * M-float buffer as the panels finish, and y written with plain stores, are
 * lines the weight stream has pushed out of L2: their reads for ownership
 * and scattered write-backs amid the stream slow it (benchmarks/c/ab_builds.sh;
 * neither the ring alone nor the streaming stores alone help;
 * benchmarks/c/read_widths.c shows the same on the kernel's bare loop).
 * The next layer then reads y from memory, not cache, which decode did not
 * notice. One output step per thread, not per panel. */
#define RING_PANELS 8

/* The output step of panels [c0, c1), whose results start at facc. */
static void store_panels(const linear_job *job, const float *facc, int64_t c0, int64_t c1) {
    int64_t m0;
    const int64_t rows = panel_rows(job->w, c0, c1, &m0);
    job->store(&job->out, facc, 0, 1, m0, rows);
}

static void one_token_panels(const linear_job *job, const ulb_acts *acts, int64_t p0, int64_t p1) {
    const ulb_weight *w = job->w;
    float *const facc1 = job->q->facc1;
    float ring[2][RING_PANELS * ULB_PANEL_ROWS] __attribute__((aligned(64)));
    /* Without the ring, every panel of the thread in one chunk of facc1. */
    const int64_t chunk = facc1 ? p1 - p0 : RING_PANELS;
    /* With a pair kernel, the first half of the thread's full panels with
     * the second, a panel of each at a time. */
    const int64_t full = w->M_pad / ULB_PANEL_ROWS;
    const int64_t half = job->pair ? ((p1 < full ? p1 : full) - p0) / 2 : 0;
    for (int64_t i0 = 0; i0 < half; i0 += chunk) {
        const int64_t i1 = i0 + chunk < half ? i0 + chunk : half;
        float *a = facc1 ? facc1 + (p0 + i0) * ULB_PANEL_ROWS : ring[0];
        float *b = facc1 ? facc1 + (p0 + half + i0) * ULB_PANEL_ROWS : ring[1];
        for (int64_t i = i0; i < i1; i++)
            job->pair(w, p0 + i, p0 + half + i, acts, a + (i - i0) * ULB_PANEL_ROWS, b + (i - i0) * ULB_PANEL_ROWS);
        store_panels(job, a, p0 + i0, p0 + i1);
        store_panels(job, b, p0 + half + i0, p0 + half + i1);
    }
    for (int64_t c0 = p0 + 2 * half; c0 < p1; c0 += chunk) {
        const int64_t c1 = c0 + chunk < p1 ? c0 + chunk : p1;
        float *r = facc1 ? facc1 + c0 * ULB_PANEL_ROWS : ring[0];
        for (int64_t p = c0; p < c1; p++)
            job->panel(w, p * ULB_PANEL_TILES, ulb_panel_ntiles(w->M_pad, p), acts, 0, 1,
                       r + (p - c0) * ULB_PANEL_ROWS, NULL);
        store_panels(job, r, c0, c1);
    }
}

static void linear_panels(void *ctx, int64_t p0, int64_t p1) {
    linear_job *job = ctx;
    const ulb_weight *w = job->w;
    if (!acts_ready(job, ulb_weight_panels_end(w, p0), ulb_weight_panels_end(w, p1))) return;
    ulb_acts acts = job->q->acts;
    acts.prefetch_end = ulb_weight_panels_end(w, p1);
    if (job->N == 1) {
        one_token_panels(job, &acts, p0, p1);
        return;
    }
    if (job->gemm) {
        gemm_panels(job, &acts, p0, p1);
        return;
    }
    float facc[ULB_NB_MAX * ULB_PANEL_ROWS] __attribute__((aligned(64)));
    for (int64_t p = p0; p < p1; p++) {
        int64_t m0;
        const int64_t rows = panel_rows(w, p, p + 1, &m0);
        for (int64_t n0 = 0; n0 < job->N; n0 += ULB_NB_MAX) {
            const int nb = job->N - n0 < ULB_NB_MAX ? (int)(job->N - n0) : ULB_NB_MAX;
            job->panel(w, p * ULB_PANEL_TILES, ulb_panel_ntiles(w->M_pad, p), &acts, n0, nb, facc, NULL);
            job->store(&job->out, facc, n0, nb, m0, rows);
        }
    }
}

/* Sets up one layer's job over its weight view w (checked by the caller):
 * its activations' scratch (q) and its kernels, for nthreads threads. */
static ulb_status linear_job_init(const ulb_linear_args *a, ulb_dtype x_dt, ulb_dtype bias_dt, ulb_dtype y_dt,
                                  int nthreads, ulb_isa isa, ulb_weight *w, quantized_acts *q, linear_job *job) {
    const int64_t N = a->N;
    const ulb_lut1_build_fn lut1_build = use_lut1(w, N, nthreads, isa);
    const ulb_gemm_kernel *gemm = ulb_gemm_for(isa, w, N);
    const ulb_status st = acts_alloc(w, lut1_build, gemm, nthreads, N, q);
    if (st != ULB_OK) return st;
    /* Two claims per thread: enough to even out a late thread, few atomics. */
    const int64_t claims = 2 * (int64_t)(nthreads > 1 ? nthreads : 1), claim = (N + claims - 1) / claims;
    const ulb_panel_pair_fn pair = use_pairs(w, N, nthreads) ? ulb_panel_pair_for(isa, w, lut1_build != NULL) : NULL;
    *job = (linear_job){w, q, {a->x, x_dt, a->ldx, a->incx}, N, claim, 0, 0, ULB_OK, nthreads == 1,
                        ulb_panel_for(isa, w), pair, gemm, ulb_store_for_isa(isa),
                        {q->xscale, a->bias, bias_dt, a->y, y_dt, a->ldy, N == 1 && ring_output(w)}};
    return ULB_OK;
}

/* Several layers as one parallel region: unit u of the region is panel
 * u - first[i] of layer i, for first[i] <= u < first[i + 1]. */
typedef struct {
    linear_job *jobs;
    const int64_t *first;
    int count;
} layers_job;

static void layers_panels(void *ctx, int64_t u0, int64_t u1) {
    const layers_job *job = ctx;
    for (int i = 0; i < job->count && job->first[i] < u1; i++) {
        const int64_t lo = u0 > job->first[i] ? u0 : job->first[i];
        const int64_t hi = u1 < job->first[i + 1] ? u1 : job->first[i + 1];
        if (hi > lo) linear_panels(&job->jobs[i], lo - job->first[i], hi - job->first[i]);
    }
}

/* The driver of ulb_linear and ulb_linear_many. The caller provides the
 * arrays of count entries (first: count + 1), so that ulb_linear, the
 * decode path, keeps them on its stack rather than allocate them. */
static ulb_status linear_layers(const ulb_linear_args *layers, int count, ulb_dtype x_dt, ulb_dtype bias_dt,
                                ulb_dtype y_dt, int nthreads, ulb_weight *w, quantized_acts *q, linear_job *jobs,
                                int64_t *first) {
    int64_t work_bytes = 0;
    int bits = 0, biased = 0;
    first[0] = 0;
    for (int i = 0; i < count; i++) {
        const ulb_linear_args *a = &layers[i];
        const ulb_status st = ulb_weight_view(a->blob, a->nbytes, &w[i]);
        if (st != ULB_OK) return st;
        if (a->N < 0 || a->ldy < w[i].M) return ULB_ERR_SHAPE;
        work_bytes += (a->nbytes - ULB_HEADER_BYTES) * a->N;
        first[i + 1] = first[i] + (a->N ? ulb_weight_npanels(&w[i]) : 0);
        if (a->N && !bits) bits = w[i].bits;
        biased |= a->bias != NULL;
    }
    if ((x_dt != ULB_DT_F32 && x_dt != ULB_DT_BF16) || (y_dt != ULB_DT_F32 && y_dt != ULB_DT_BF16) ||
        (biased && bias_dt != ULB_DT_F32 && bias_dt != ULB_DT_BF16))
        return ULB_ERR_DTYPE;
    if (first[count] == 0) return ULB_OK;
    const ulb_isa isa = ulb_isa_active();
    if (work_bytes < ULB_PARALLEL_MIN_BYTES) nthreads = 1;
    if (nthreads > first[count]) nthreads = (int)first[count]; /* as ulb_parallel will */
    /* Every layer's scratch is set (allocated, or NULL) before any is used,
     * so one loop frees them whatever failed. */
    ulb_status st = ULB_OK;
    for (int i = 0; i < count; i++) {
        q[i].scratch = NULL;
        if (st == ULB_OK && layers[i].N)
            st = linear_job_init(&layers[i], x_dt, bias_dt, y_dt, nthreads, isa, &w[i], &q[i], &jobs[i]);
    }
    if (st == ULB_OK) {
        layers_job job = {jobs, first, count};
        st = ulb_parallel(ulb_sched_family(bits, isa), nthreads, first[count], layers_panels, &job);
    }
    for (int i = 0; i < count; i++) {
        if (st == ULB_OK && layers[i].N) st = jobs[i].acts_status;
        acts_free(&q[i]);
    }
    return st;
}

ulb_status ulb_linear(const uint8_t *blob, int64_t nbytes, int64_t N, const void *x,
                      ulb_dtype x_dt, int64_t ldx, int64_t incx, const void *bias,
                      ulb_dtype bias_dt, void *y, ulb_dtype y_dt, int64_t ldy, int nthreads) {
    const ulb_linear_args a = {blob, nbytes, N, x, ldx, incx, bias, y, ldy};
    ulb_weight w;
    quantized_acts q;
    linear_job job;
    int64_t first[2];
    return linear_layers(&a, 1, x_dt, bias_dt, y_dt, nthreads, &w, &q, &job, first);
}

ulb_status ulb_linear_many(const ulb_linear_args *layers, int count, ulb_dtype x_dt, ulb_dtype bias_dt,
                           ulb_dtype y_dt, int nthreads) {
    if (count < 0) return ULB_ERR_SHAPE;
    const size_t n = (size_t)count;
    char *mem = malloc(n * (sizeof(ulb_weight) + sizeof(quantized_acts) + sizeof(linear_job) + sizeof(int64_t)) +
                       sizeof(int64_t));
    if (!mem) return ULB_ERR_NOMEM;
    linear_job *jobs = (linear_job *)mem;
    ulb_weight *w = (ulb_weight *)(jobs + n);
    quantized_acts *q = (quantized_acts *)(w + n);
    int64_t *first = (int64_t *)(q + n);
    const ulb_status st = linear_layers(layers, count, x_dt, bias_dt, y_dt, nthreads, w, q, jobs, first);
    free(mem);
    return st;
}

/* Whether xq (N x K_pad) and xsum are what ulb_quantize_act gives: zeros
 * past K and each group's sum. The kernels rely on it in different ways
 * (the AMX GEMM multiplies signed levels and reads the padding, the others
 * take the level offset from xsum), so other input would make the result
 * depend on the ISA. */
static int acts_consistent(const ulb_weight *w, int64_t N, const int8_t *xq, const int32_t *xsum) {
    const int64_t group = w->gsteps * ulb_tile_k(w->bits);
    int32_t sums[64];
    for (int64_t n = 0; n < N; n++) {
        const int8_t *q = xq + n * w->K_pad;
        for (int64_t k = w->K; k < w->K_pad; k++)
            if (q[k]) return 0;
        for (int64_t g0 = 0; g0 < w->n_groups; g0 += 64) {
            const int64_t ng = w->n_groups - g0 < 64 ? w->n_groups - g0 : 64;
            const int64_t k0 = g0 * group, k1 = k0 + ng * group < w->K_pad ? k0 + ng * group : w->K_pad;
            ulb_group_sums_ref(q + k0, k1 - k0, group, sums);
            if (memcmp(sums, xsum + n * w->n_groups + g0, (size_t)ng * sizeof(int32_t))) return 0;
        }
    }
    return 1;
}

ulb_status ulb_int_dots(const uint8_t *blob, int64_t nbytes, int64_t N, const int8_t *xq,
                        const int32_t *xsum, int32_t *dots) {
    ulb_weight w;
    ulb_status st = ulb_weight_view(blob, nbytes, &w);
    if (st != ULB_OK) return st;
    if (N < 0 || !acts_consistent(&w, N, xq, xsum)) return ULB_ERR_SHAPE;
    const ulb_isa isa = ulb_isa_active();
    const ulb_panel_fn fn = ulb_panel_for(isa, &w);
    const ulb_gemm_kernel *gemm = ulb_gemm_for(isa, &w, N);
    const int64_t G = w.n_groups;
    const ulb_lut1_build_fn lut1_build = use_lut1(&w, N, 1, isa);
    const int lut = lut1_build != NULL;
    /* Tokens per kernel call; with a GEMM kernel a copy of xq as it reads it
     * (xq_bytes_for) and its scratch. */
    const int64_t nb_max = gemm ? (N < gemm->tokens ? N : gemm->tokens) : ULB_NB_MAX;
    const size_t pd_bytes = (size_t)ulb_round_up(nb_max * G * ULB_PANEL_ROWS * (int64_t)sizeof(int32_t), 64);
    const size_t facc_bytes = (size_t)(nb_max * ULB_PANEL_ROWS) * sizeof(float);
    const size_t lut_bytes = lut ? (size_t)(N * w.ksteps * ULB_LUT1_STEP_BYTES) : 0;
    const size_t xq_bytes = gemm ? (size_t)ulb_round_up(xq_bytes_for(&w, N, gemm), 64) : 0;
    const size_t scratch_bytes = gemm ? (size_t)gemm->scratch_bytes(&w) : 0;
    int32_t *pd = ulb_aligned_alloc(pd_bytes + facc_bytes + lut_bytes + xq_bytes + scratch_bytes);
    if (!pd) return ULB_ERR_NOMEM;
    float *facc = (float *)((uint8_t *)pd + pd_bytes);
    uint8_t *lut1 = lut ? (uint8_t *)facc + facc_bytes : NULL;
    for (int64_t n = 0; lut && n < N; n++)
        lut1_build(xq + n * w.K_pad, w.ksteps, lut1 + n * w.ksteps * ULB_LUT1_STEP_BYTES);
    int8_t *xq_gemm = gemm ? (int8_t *)facc + facc_bytes + lut_bytes : NULL;
    uint8_t *scratch = gemm ? (uint8_t *)xq_gemm + xq_bytes : NULL;
    if (gemm) {
        memcpy(xq_gemm, xq, (size_t)(N * w.K_pad));
        memset(xq_gemm + N * w.K_pad, 0, xq_bytes - (size_t)(N * w.K_pad));
        gemm->begin(&w);
    }
    const ulb_acts acts = ulb_acts_of(&w, N, gemm ? xq_gemm : xq, xsum, lut1, 1);
    for (int64_t p = 0; p * ULB_PANEL_ROWS < w.M_pad; p++) {
        const int64_t m0 = p * ULB_PANEL_ROWS;
        for (int64_t n0 = 0; n0 < N; n0 += nb_max) {
            const int nb = N - n0 < nb_max ? (int)(N - n0) : (int)nb_max;
            if (gemm)
                gemm->panel(&w, p, &acts, n0, nb, scratch, facc, pd);
            else
                fn(&w, p * ULB_PANEL_TILES, ulb_panel_ntiles(w.M_pad, p), &acts, n0, nb, facc, pd);
            for (int j = 0; j < nb; j++)
                for (int64_t r = 0; r < ULB_PANEL_ROWS && m0 + r < w.M; r++)
                    for (int64_t g = 0; g < G; g++)
                        dots[((n0 + j) * w.M + m0 + r) * G + g] = pd[(j * G + g) * ULB_PANEL_ROWS + r];
        }
    }
    if (gemm) gemm->end();
    ulb_aligned_free(pd);
    return ULB_OK;
}
