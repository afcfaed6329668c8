/* The ARMv8.0 NEON microkernels (every AArch64 CPU): panel_neon_body.h, the
 * dot products from smull/smlal. */
#pragma GCC target("arch=armv8-a")
/* GCC's scheduling before register allocation hoists the field extractions
 * of whole k-steps ahead of their dot products, and spills. */
#pragma GCC optimize("no-schedule-insns")
#define ULB_ARM_LEVEL 0
#define ULB_PANEL_ARM_FN ulb_panel_neon
#include "panel_neon_body.h"
