/* The AVX2 microkernels with AVX-VNNI (VEX vpdpbusd on 256 bits) in place of
 * vpmaddubsw + vpmaddwd for the fields of 1-, 2- and 4-bit codes: Intel
 * client cores from Alder Lake on, which lack AVX-512. Body:
 * panel_avx2_body.h. Built with -DULB_EMULATE_AVXVNNI, vpdpbusd is computed
 * exactly from AVX2 and the ISA reports itself supported wherever AVX2 is,
 * so tests/test_c_kernels.py checks this kernel against the scalar reference
 * on CPUs without AVX-VNNI too. */
#ifdef ULB_EMULATE_AVXVNNI
#pragma GCC target("avx2")
#else
#pragma GCC target("avx2,avxvnni")
#endif
#define ULB_AVX2_VNNI 1
#define ULB_PANEL_AVX2_FN ulb_panel_avxvnni
#include "panel_avx2_body.h"
