// NEON intrinsics on aarch64; the same source through SIMDe (portable emulation) elsewhere.
#pragma once
#if defined(__aarch64__)
#include <arm_neon.h>
#else
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/arm/neon.h>
#endif
