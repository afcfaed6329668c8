/* The FEAT_DotProd microkernels (Cortex-A76 / Neoverse N1 on, Apple M1 on):
 * panel_neon_body.h with sdot. */
#pragma GCC target("arch=armv8.2-a+dotprod")
/* GCC's scheduling before register allocation hoists the field extractions
 * of whole k-steps ahead of their dot products, and spills. */
#pragma GCC optimize("no-schedule-insns")
#define ULB_ARM_LEVEL 1
#define ULB_PANEL_ARM_FN ulb_panel_dotprod
#include "panel_neon_body.h"
