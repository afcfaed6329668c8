/* ISA selection: once, at load (CPUID on x86-64, the kernel's HWCAPs on
 * AArch64, or env ULB_ISA=scalar|avx2|avx512|avxvnni|portable|amx|neon|dotprod|i8mm);
 * tests switch explicitly with ulb_isa_set to cover every path. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h> /* ULB_ARM */
#endif

#include "internal.h"

static const char *const ISA_NAMES[ULB_ISA_COUNT] = {"scalar", "avx2",     "avx512",  "avxvnni", "portable",
                                                     "amx",    "neon",     "dotprod", "i8mm"};

#if defined(__x86_64__)
/* AMX int8 tiles usable by this process: the CPU has them (CPUID.7.0:EDX
 * bits 24-25), the OS saves their state (XCR0 bits 17-18), and Linux grants
 * the process their data (arch_prctl ARCH_REQ_XCOMP_PERM; without it the
 * first tile instruction faults). Asked once; the grant is per process. */
static int amx_usable;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || (d & (3u << 24)) != (3u << 24)) return;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return; /* OSXSAVE: xgetbv allowed */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return;
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    amx_usable = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif

#if ULB_ARM
/* NEON, FEAT_DotProd and FEAT_I8MM as Linux reports them: HWCAP_ASIMD,
 * HWCAP_ASIMDDP, HWCAP2_I8MM (the values of <asm/hwcap.h>, which older C
 * libraries lack). */
#define ULB_HWCAP_ASIMD (1ul << 1)
#define ULB_HWCAP_ASIMDDP (1ul << 20)
#define ULB_HWCAP2_I8MM (1ul << 13)
static int arm_supported(ulb_isa isa) {
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    const int neon = (hw & ULB_HWCAP_ASIMD) != 0, dot = neon && (hw & ULB_HWCAP_ASIMDDP);
    switch (isa) {
    case ULB_ISA_NEON: return neon;
    case ULB_ISA_DOTPROD: return dot;
    case ULB_ISA_I8MM: return dot && (hw2 & ULB_HWCAP2_I8MM);
    default: return 0;
    }
}

static int arm_isa(ulb_isa isa) { return isa == ULB_ISA_NEON || isa == ULB_ISA_DOTPROD || isa == ULB_ISA_I8MM; }
#endif

const char *ulb_isa_name(ulb_isa isa) {
    return (unsigned)isa < ULB_ISA_COUNT ? ISA_NAMES[isa] : "unknown";
}

int ulb_isa_supported(ulb_isa isa) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    switch (isa) {
    case ULB_ISA_SCALAR:
    case ULB_ISA_PORTABLE: return 1;
    case ULB_ISA_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case ULB_ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case ULB_ISA_AVXVNNI:
#ifdef ULB_EMULATE_AVXVNNI /* panel_avxvnni.c: vpdpbusd from AVX2, for tests */
        return ulb_isa_supported(ULB_ISA_AVX2);
#else
        return ulb_isa_supported(ULB_ISA_AVX2) && __builtin_cpu_supports("avxvnni");
#endif
    case ULB_ISA_AMX:
#if defined(__x86_64__)
        /* VBMI too: the AMX kernel turns LANES tiles into VNNI ones with vpermb. */
        pthread_once(&amx_once, amx_probe);
        return amx_usable && ulb_isa_supported(ULB_ISA_AVX512) && __builtin_cpu_supports("avx512vbmi");
#else
        return 0;
#endif
    default: return 0;
    }
#elif ULB_ARM
    return isa == ULB_ISA_SCALAR || isa == ULB_ISA_PORTABLE || arm_supported(isa);
#else
    return isa == ULB_ISA_SCALAR || isa == ULB_ISA_PORTABLE;
#endif
}

static _Atomic int active_isa = -1;
static ulb_isa cpu_best = ULB_ISA_PORTABLE; /* set once by isa_init */
static int cpu_intel;                          /* likewise */
static int cpu_amd_family;                     /* likewise */
static _Atomic int lut1_mode = ULB_LUT1_AUTO;
static pthread_once_t isa_once = PTHREAD_ONCE_INIT;

static void isa_init(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    cpu_intel = __builtin_cpu_is("intel");
#endif
#if defined(__x86_64__)
    unsigned eax, ebx, ecx, edx;
    if (__builtin_cpu_is("amd") && __get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
        const unsigned base = (eax >> 8) & 0xf;
        cpu_amd_family = (int)(base == 0xf ? base + ((eax >> 20) & 0xff) : base);
    }
#endif
    if (ulb_isa_supported(ULB_ISA_AVX2)) cpu_best = ULB_ISA_AVX2;
    if (ulb_isa_supported(ULB_ISA_AVXVNNI)) cpu_best = ULB_ISA_AVXVNNI;
    if (ulb_isa_supported(ULB_ISA_AVX512)) cpu_best = ULB_ISA_AVX512;
    if (ulb_isa_supported(ULB_ISA_AMX)) cpu_best = ULB_ISA_AMX;
    if (ulb_isa_supported(ULB_ISA_NEON)) cpu_best = ULB_ISA_NEON;
    if (ulb_isa_supported(ULB_ISA_DOTPROD)) cpu_best = ULB_ISA_DOTPROD;
    if (ulb_isa_supported(ULB_ISA_I8MM)) cpu_best = ULB_ISA_I8MM;
    ulb_isa best = cpu_best;
    const char *lut = getenv("ULB_LUT1");
    if (lut && !strcmp(lut, "0")) atomic_store(&lut1_mode, ULB_LUT1_OFF);
    if (lut && !strcmp(lut, "1")) atomic_store(&lut1_mode, ULB_LUT1_ON);
    const char *env = getenv("ULB_ISA");
    if (env)
        for (int i = 0; i < ULB_ISA_COUNT; i++)
            if (!strcmp(env, ISA_NAMES[i]) && ulb_isa_supported((ulb_isa)i)) best = (ulb_isa)i;
    atomic_store(&active_isa, (int)best);
}

ulb_isa ulb_isa_best(void) {
    pthread_once(&isa_once, isa_init);
    return cpu_best;
}

int ulb_cpu_intel(void) {
    pthread_once(&isa_once, isa_init);
    return cpu_intel;
}

int ulb_cpu_amd_family(void) {
    pthread_once(&isa_once, isa_init);
    return cpu_amd_family;
}

ulb_isa ulb_isa_active(void) {
    pthread_once(&isa_once, isa_init);
    return (ulb_isa)atomic_load(&active_isa);
}

ulb_status ulb_isa_set(ulb_isa isa) {
    pthread_once(&isa_once, isa_init);
    if ((unsigned)isa >= ULB_ISA_COUNT || !ulb_isa_supported(isa)) return ULB_ERR_ISA;
    atomic_store(&active_isa, (int)isa);
    return ULB_OK;
}

ulb_status ulb_lut1_set(int mode) {
    pthread_once(&isa_once, isa_init);
    if (mode != ULB_LUT1_OFF && mode != ULB_LUT1_ON && mode != ULB_LUT1_AUTO) return ULB_ERR_SHAPE;
    atomic_store(&lut1_mode, mode);
    return ULB_OK;
}

int ulb_lut1_get(void) {
    pthread_once(&isa_once, isa_init);
    return atomic_load(&lut1_mode);
}

#if defined(__x86_64__)
/* AVX-512 VBMI's lookups, over VNNI tiles. */
static int lut1_vnni_available(ulb_isa isa) {
    return (isa == ULB_ISA_AVX512 || isa == ULB_ISA_AMX) && ulb_isa_supported(ULB_ISA_AVX512) &&
           __builtin_cpu_supports("avx512vbmi");
}
#endif

int ulb_lut1_available(ulb_isa isa) {
#if defined(__x86_64__)
    return ulb_isa_supported(isa) &&
           (isa == ULB_ISA_AVX2 || isa == ULB_ISA_AVXVNNI || isa == ULB_ISA_AVX512 || isa == ULB_ISA_AMX);
#elif ULB_ARM
    return arm_isa(isa) && ulb_isa_supported(isa);
#else
    (void)isa;
    return 0;
#endif
}

int ulb_lut1_serves(int tiles, int64_t ntokens, int nthreads, ulb_isa isa) {
    const int mode = ulb_lut1_get();
    if (mode == ULB_LUT1_OFF || ntokens < 1) return 0;
#if ULB_ARM
    /* Either tile order, any thread count. Masking shared by several tokens
     * takes fewer instructions per token than a lookup pass each with smmla,
     * and with sdot over VNNI tiles; more without them, or over LANES tiles,
     * which masking reorders first (benchmarks/insn_per_weight.py). */
    (void)nthreads;
    if (tiles != ULB_TILES_VNNI && tiles != ULB_TILES_LANES) return 0;
    const int several =
        mode == ULB_LUT1_ON || isa == ULB_ISA_NEON || (isa == ULB_ISA_DOTPROD && tiles == ULB_TILES_LANES);
    return ulb_lut1_available(isa) && ntokens <= (several ? ULB_LUT1_MAX_TOKENS : 1);
#endif
    if (tiles == ULB_TILES_LANES) return ntokens <= ULB_LUT1_MAX_TOKENS && ulb_lut1_available(isa);
#if defined(__x86_64__)
    /* VNNI tiles: one token on one thread; with two the masking kernel
     * streams better and the tables only add cache traffic
     * (benchmarks/c/ab_builds.sh), and under "auto" only where it paid (ulb.h). */
    return tiles == ULB_TILES_VNNI && ntokens == 1 && nthreads <= 1 && lut1_vnni_available(isa) &&
           (mode == ULB_LUT1_ON || ulb_cpu_intel() || ulb_cpu_amd_family() == 0x19);
#else
    (void)nthreads;
    return 0;
#endif
}

ulb_lut1_build_fn ulb_lut1_builder_for(const ulb_weight *w, ulb_isa isa) {
#if defined(__x86_64__)
    if (w->bits != 1) return NULL;
    if (w->tiles == ULB_TILES_LANES)
        return ulb_lut1_available(isa) ? ulb_lut1_lanes_build_avx2 : NULL;
    if (lut1_vnni_available(isa)) return ulb_lut1_build_avx512;
#elif ULB_ARM
    if (w->bits == 1 && ulb_lut1_available(isa)) return ulb_lut1_build_neon;
#endif
    (void)w;
    (void)isa;
    return NULL;
}

/* Base-3 codes: AVX-512 with VBMI's vpermi2b looks their digits up; every
 * other x86 ISA from AVX2 runs the AVX2 kernel's multiplies; elsewhere the
 * portable one. */
static ulb_panel_fn base3_panel_for_isa(ulb_isa isa) {
    switch (isa) {
#if defined(__x86_64__)
    case ULB_ISA_AVX512:
    case ULB_ISA_AMX:
        if (__builtin_cpu_supports("avx512vbmi")) return ulb_panel_base3_avx512;
        return ulb_panel_base3_avx2;
    case ULB_ISA_AVX2:
    case ULB_ISA_AVXVNNI: return ulb_panel_base3_avx2;
#endif
    case ULB_ISA_SCALAR: return ulb_panel_ref;
    default: return ulb_panel_base3_portable;
    }
}

ulb_panel_fn ulb_panel_for(ulb_isa isa, const ulb_weight *w) {
    return w->bits == ULB_BASE3_BITS ? base3_panel_for_isa(isa) : ulb_panel_for_isa(isa);
}

ulb_panel_fn ulb_panel_for_isa(ulb_isa isa) {
    switch (isa) {
#if defined(__x86_64__)
    case ULB_ISA_AVX512:
    case ULB_ISA_AMX: return ulb_panel_avx512; /* the AMX GEMM is linear.c's choice, by token count */
    case ULB_ISA_AVX2: return ulb_panel_avx2;
    case ULB_ISA_AVXVNNI: return ulb_panel_avxvnni;
#endif
#if ULB_ARM
    case ULB_ISA_NEON: return ulb_panel_neon;
    case ULB_ISA_DOTPROD: return ulb_panel_dotprod;
    case ULB_ISA_I8MM: return ulb_panel_i8mm;
#endif
    case ULB_ISA_PORTABLE: return ulb_panel_portable;
    default: return ulb_panel_ref;
    }
}

const ulb_gemm_kernel *ulb_gemm_for(ulb_isa isa, const ulb_weight *w, int64_t N) {
#if defined(__x86_64__)
    if (isa == ULB_ISA_AMX && N >= ULB_AMX_MIN_TOKENS) return &ulb_gemm_amx; /* base 3 too */
#elif ULB_ARM
    /* i8mm unpacks bit fields only. */
    if (isa == ULB_ISA_I8MM && N >= ULB_I8MM_MIN_TOKENS && w->bits != ULB_BASE3_BITS) return &ulb_gemm_i8mm;
#endif
    (void)isa;
    (void)w;
    (void)N;
    return NULL;
}

ulb_panel_pair_fn ulb_panel_pair_for(ulb_isa isa, const ulb_weight *w, int lut1) {
#if defined(__x86_64__)
    if (isa == ULB_ISA_AVX2 && w->bits != 1 && w->bits != ULB_BASE3_BITS) return ulb_panel_pair_avx2;
    /* 1-bit: the AVX2 lookups over LANES tiles, which serve those blobs under AVX-512 too. */
    if (w->bits == 1 && lut1 && w->tiles == ULB_TILES_LANES) return ulb_panel_pair_avx2;
#endif
    (void)isa;
    (void)w;
    (void)lut1;
    return NULL;
}

ulb_store_fn ulb_store_for_isa(ulb_isa isa) {
#if defined(__x86_64__)
    if (isa == ULB_ISA_AVX512 || isa == ULB_ISA_AMX) return ulb_store_rows_avx512;
#endif
    (void)isa;
    return ulb_store_rows_ref; /* AVX2 too: no AVX2 step written or measured yet */
}

ulb_quant_row_fn ulb_quant_row_for_isa(ulb_isa isa) {
    switch (isa) {
#if defined(__x86_64__)
    case ULB_ISA_AVX512:
    case ULB_ISA_AMX: return ulb_quant_row_avx512;
    case ULB_ISA_AVX2:
    case ULB_ISA_AVXVNNI: return ulb_quant_row_avx2;
#endif
#if ULB_ARM
    case ULB_ISA_NEON:
    case ULB_ISA_DOTPROD:
    case ULB_ISA_I8MM: return ulb_quant_row_neon;
#endif
    default: return ulb_quant_row_ref;
    }
}

ulb_gemv_bf16_rows_fn ulb_gemv_bf16_rows_for_isa(ulb_isa isa) {
    switch (isa) {
#if defined(__x86_64__)
    case ULB_ISA_AVX512:
    case ULB_ISA_AMX: return ulb_cpu_intel() ? ulb_gemv_bf16_rows2_avx512 : ulb_gemv_bf16_rows_avx512;
    case ULB_ISA_AVX2:
    case ULB_ISA_AVXVNNI: return ulb_gemv_bf16_rows_avx2;
#endif
#if ULB_ARM
    case ULB_ISA_NEON:
    case ULB_ISA_DOTPROD:
    case ULB_ISA_I8MM: return ulb_gemv_bf16_rows_neon;
#endif
    default: return ulb_gemv_bf16_rows_ref;
    }
}
