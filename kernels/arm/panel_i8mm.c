/* The FEAT_I8MM microkernels (Neoverse V1/N2 on, Apple M2 on):
 * panel_neon_body.h with sdot, usdot for 8-bit codes, and smmla/usmmla for
 * several tokens. */
#pragma GCC target("arch=armv8.2-a+dotprod+i8mm")
/* GCC's scheduling before register allocation hoists the field extractions
 * of whole k-steps ahead of their dot products, and spills. */
#pragma GCC optimize("no-schedule-insns")
#define ULB_ARM_LEVEL 2
#define ULB_PANEL_ARM_FN ulb_panel_i8mm
#include "panel_neon_body.h"
