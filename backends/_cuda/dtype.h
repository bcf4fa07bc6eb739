// Element types passed from the torch bindings to the torch-free CUDA launchers.
#pragma once

namespace qlinear {
enum class DType : int { kHalf = 0, kBFloat16 = 1, kFloat = 2, kNone = 3 };
}  // namespace qlinear
