/* The AVX2 microkernels (vpmaddubsw + vpmaddwd): panel_avx2_body.h. */
#pragma GCC target("avx2")
#define ULB_AVX2_VNNI 0
#define ULB_PANEL_AVX2_FN ulb_panel_avx2
#include "panel_avx2_body.h"
