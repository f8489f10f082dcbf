// metrale::linear_rows on x86 CPUs with AVX-512 or AVX2 + FMA: a projection of a compiled step's
// rows, y = x · B, as AOTInductor packages call it (`plugins/cpu_linear.py`): the target's LM
// head, the largest projection of a step (the tiny target's: 128 x 2048).
//
// x [N, K] float32; B [K, C] held in panels of 16 columns (`cpu_tiles.h`): [C/16, K, 16], float32
// or bfloat16 bits (`metrale_linear_rows_bf16`, widened exactly as they are loaded); y [N, C].
// The columns go in blocks of BLOCK, and inside a block every tile of rows in turn, so a block's
// panels are read from the L2 once per call and then from L1 by the other rows' tiles. Every
// output is one in-order chain of fused multiply-adds over k, from zero: a row's bits depend on
// its own input only, never on the other rows of the call (the batched step's contract), and
// are the same on either ISA.

#include <algorithm>
#include <cstdint>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "cpu_tiles.h"

namespace {
using metrale_tiles::R;
using metrale_tiles::tile_m;
constexpr int64_t BLOCK = 256;  // columns a block: 128 KB of float32 panels at K = 128, half that as bfloat16

template <typename T>
void linear_rows(const float* x, const T* B, float* y, int64_t N, int64_t K, int64_t C) {
  const float* a[R];
  float* o[R];
  for (int64_t c0 = 0; c0 < C; c0 += BLOCK) {
    const int64_t end = std::min(C, c0 + BLOCK);
    for (int64_t b = 0; b < N; b += R) {
      const int m = static_cast<int>(std::min<int64_t>(R, N - b));
      for (int r = 0; r < m; ++r) a[r] = x + (b + r) * K;
      for (int64_t c = c0; c < end;) {
        for (int r = 0; r < m; ++r) o[r] = y + (b + r) * C + c;
        c += tile_m(m, c, end, a, B, K, o);
      }
    }
  }
}
}  // namespace

extern "C" void metrale_linear_rows(const float* x, const float* B /*[C/16, K, 16]*/, float* y /*[N, C]*/,
                                    int64_t N, int64_t K, int64_t C) {
  linear_rows(x, B, y, N, K, C);
}

// the same with bfloat16 weights (their bits)
extern "C" void metrale_linear_rows_bf16(const float* x, const uint16_t* B /*[C/16, K, 16]*/, float* y /*[N, C]*/,
                                         int64_t N, int64_t K, int64_t C) {
  linear_rows(x, B, y, N, K, C);
}

// The C shim AOTInductor's wrapper calls for metrale::linear_rows (its name is the op's, prefixed
// as aten ops' shims are): checks the layout, allocates the output [N, C], runs the kernel.
extern "C" AOTITorchError aoti_torch_cpu_linear_rows(AtenTensorHandle x, AtenTensorHandle weight,
                                                     AtenTensorHandle* ret0) {
  int64_t dim = 0;
  if (aoti_torch_get_dim(x, &dim) || dim != 2 || aoti_torch_get_dim(weight, &dim) || dim != 3)
    return AOTI_TORCH_FAILURE;
  int64_t *xs, *ws, *st;
  if (aoti_torch_get_sizes(x, &xs) || aoti_torch_get_sizes(weight, &ws) || aoti_torch_get_strides(x, &st))
    return AOTI_TORCH_FAILURE;
  const int64_t n = xs[0], k = xs[1], c = ws[0] * metrale_tiles::PANEL;
  if (ws[1] != k || ws[2] != metrale_tiles::PANEL || (n > 1 && st[0] != k) || (k > 1 && st[1] != 1))
    return AOTI_TORCH_FAILURE;  // x row-major and dense: the kernel reads row r at r·K
  int32_t xdt = 0, wdt = 0;
  if (aoti_torch_get_dtype(x, &xdt) || xdt != aoti_torch_dtype_float32() || aoti_torch_get_dtype(weight, &wdt) ||
      (wdt != aoti_torch_dtype_float32() && wdt != aoti_torch_dtype_bfloat16()))
    return AOTI_TORCH_FAILURE;
  const int64_t sizes[2] = {n, c}, strides[2] = {c, 1};
  if (aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0, ret0))
    return AOTI_TORCH_FAILURE;
  void *px, *pw, *py;
  if (aoti_torch_get_data_ptr(x, &px) || aoti_torch_get_data_ptr(weight, &pw) || aoti_torch_get_data_ptr(*ret0, &py))
    return AOTI_TORCH_FAILURE;
  if (wdt == aoti_torch_dtype_bfloat16())
    metrale_linear_rows_bf16(static_cast<const float*>(px), static_cast<const uint16_t*>(pw), static_cast<float*>(py), n, k, c);
  else
    metrale_linear_rows(static_cast<const float*>(px), static_cast<const float*>(pw), static_cast<float*>(py), n, k, c);
  return AOTI_TORCH_SUCCESS;
}
