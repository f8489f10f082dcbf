// metrale::routed_experts on x86 CPUs with AVX-512 or AVX2 + FMA: the routed experts of a MoE
// layer for the rows of a compiled step, as AOTInductor packages call it (`plugins/cpu_moe.py`).
//
//   y[n] = sum_j weights[n, j] * D_e (silu(g) * u),  [g; u] = GU_e x[n],  e = ids[n, j]
//
// gate_up [E, H, 2I] (gate columns [0, I), up columns [I, 2I)) and down [E, I, H], each expert's
// matrix held in panels of 16 columns (`cpu_tiles.h`): gate_up [E, 2I/16, H, 16], down
// [E, H/16, I, 16]; x [N, H], ids and weights [N, k], all contiguous, float32 (ids int64); H
// and I whole 16-float vectors.
// The expert weights may instead be bfloat16 (`metrale_routed_experts_bf16`): each is widened to
// the float32 it stands for, exactly, as it is loaded, so the arithmetic and the bits are those of
// the float32 kernel on the widened weights, and a step streams half the bytes (at 32 rows the
// tiny target's experts are most of a step's weight traffic, read from beyond the L2 each step).
//
// The (row, slot) pairs are grouped by expert, so an expert's weights are read once per call
// for all of its pairs, and several pairs share each load in registers (`cpu_tiles.h`: up to
// eight pairs x two vectors of columns with AVX-512, six x two with AVX2). Every output element
// is one chain of fused multiply-adds over its input features, in order, from zero, whatever
// the tile's shape or the vector width: a row's bits depend on its own input and experts only,
// never on the other rows of the call (the batched step's contract), and are the same on
// either ISA. A row's pairs are summed in slot order.

#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "cpu_simd.h"
#include "cpu_tiles.h"

namespace {
namespace simd = metrale_simd;
using simd::vec;
using simd::W;
using metrale_tiles::MAX_NV;
using metrale_tiles::R;
using metrale_tiles::tile_m;

// the kernel over expert weights of type T: float, or uint16_t holding bfloat16 bits
template <typename T>
void routed_experts(const float* x, const int64_t* ids, const float* wts, const T* gate_up /*[E, 2I/16, H, 16]*/,
                    const T* down /*[E, H/16, I, 16]*/, float* out /*[N, H]*/, int64_t N, int64_t K, int64_t E,
                    int64_t H, int64_t I) {
  const int64_t P = N * K, I2 = 2 * I;
  thread_local std::vector<int64_t> start, at, order;
  thread_local std::vector<float> act, y;  // kept between calls: no allocation once warm
  start.assign(E + 1, 0);
  order.resize(P);
  act.resize(P * I);
  y.resize(P * H);
  for (int64_t p = 0; p < P; ++p) start[ids[p] + 1]++;
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  at.assign(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < P; ++p) order[at[ids[p]]++] = p;  // pairs grouped by expert
  float gate[R][W * MAX_NV], up[R][W * MAX_NV];
  const float* a[R];
  float* o[R];
  float* o2[R];
  for (int64_t e = 0; e < E; ++e) {
    const int64_t lo = start[e], hi = start[e + 1];
    if (lo == hi) continue;
    const T* gu = gate_up + e * H * I2;
    for (int64_t b = lo; b < hi; b += R) {
      const int m = static_cast<int>(std::min<int64_t>(R, hi - b));
      for (int r = 0; r < m; ++r) {
        a[r] = x + (order[b + r] / K) * H;
        o[r] = gate[r];
        o2[r] = up[r];
      }
      for (int64_t c0 = 0; c0 < I;) {  // a column tile of gate and up
        tile_m(m, c0, I, a, gu, H, o);  // gate columns c0.., then the same up columns
        const int w = tile_m(m, I + c0, I2, a, gu, H, o2);
        for (int r = 0; r < m; ++r)
          for (int c = 0; c < w; c += W) {  // silu(g) * u
            const vec g = simd::load(gate[r] + c), u = simd::load(up[r] + c);
            const vec sg = simd::div(g, simd::add(simd::set1(1.0f), simd::exp(simd::sub(simd::zero(), g))));
            simd::store(act.data() + (b + r) * I + c0 + c, simd::mul(sg, u));
          }
        c0 += w;
      }
    }
    const T* dn = down + e * I * H;
    for (int64_t b = lo; b < hi; b += R) {
      const int m = static_cast<int>(std::min<int64_t>(R, hi - b));
      for (int64_t c0 = 0; c0 < H;) {
        for (int r = 0; r < m; ++r) {
          a[r] = act.data() + (b + r) * I;
          o[r] = y.data() + order[b + r] * H + c0;
        }
        c0 += tile_m(m, c0, H, a, dn, I, o);
      }
    }
  }
  for (int64_t n = 0; n < N; ++n)  // a row's pairs summed in slot order
    for (int64_t h = 0; h < H; h += W) {
      vec s = simd::zero();
      for (int64_t j = 0; j < K; ++j)
        s = simd::fmadd(simd::set1(wts[n * K + j]), simd::load(y.data() + (n * K + j) * H + h), s);
      simd::store(out + n * H + h, s);
    }
}
}  // namespace

extern "C" void metrale_routed_experts(const float* x, const int64_t* ids, const float* wts,
                                       const float* gate_up /*[E, 2I/16, H, 16]*/, const float* down /*[E, H/16, I, 16]*/,
                                       float* out /*[N, H]*/, int64_t N, int64_t K, int64_t E,
                                       int64_t H, int64_t I) {
  routed_experts(x, ids, wts, gate_up, down, out, N, K, E, H, I);
}

// the same with bfloat16 expert weights (their bits)
extern "C" void metrale_routed_experts_bf16(const float* x, const int64_t* ids, const float* wts,
                                            const uint16_t* gate_up /*[E, 2I/16, H, 16]*/, const uint16_t* down /*[E, H/16, I, 16]*/,
                                            float* out /*[N, H]*/, int64_t N, int64_t K, int64_t E,
                                            int64_t H, int64_t I) {
  routed_experts(x, ids, wts, gate_up, down, out, N, K, E, H, I);
}


// The C shim AOTInductor's wrapper calls for metrale::routed_experts (its name is the op's,
// prefixed as aten ops' shims are): checks the layout, allocates the output, runs the kernel.
extern "C" AOTITorchError aoti_torch_cpu_routed_experts(AtenTensorHandle x, AtenTensorHandle ids,
                                                        AtenTensorHandle weights, AtenTensorHandle gate_up,
                                                        AtenTensorHandle down, AtenTensorHandle* ret0) {
  int64_t dim = 0;
  if (aoti_torch_get_dim(x, &dim) || dim != 2 || aoti_torch_get_dim(gate_up, &dim) || dim != 4 ||
      aoti_torch_get_dim(down, &dim) || dim != 4)
    return AOTI_TORCH_FAILURE;
  int64_t *xs, *is, *gs, *ds;  // gate_up [E, 2I/16, H, 16], down [E, H/16, I, 16]: panels
  if (aoti_torch_get_sizes(x, &xs) || aoti_torch_get_sizes(ids, &is) || aoti_torch_get_sizes(gate_up, &gs) ||
      aoti_torch_get_sizes(down, &ds))
    return AOTI_TORCH_FAILURE;
  const int64_t n = xs[0], h = xs[1], k = is[1], e = gs[0], i2 = gs[1] * metrale_tiles::PANEL;
  if (gs[2] != h || gs[3] != metrale_tiles::PANEL || i2 % 32 != 0 || h % 16 != 0 || is[0] != n ||
      ds[0] != e || ds[1] * metrale_tiles::PANEL != h || ds[2] != i2 / 2 || ds[3] != metrale_tiles::PANEL)
    return AOTI_TORCH_FAILURE;
  int32_t gdt = 0, ddt = 0;  // the expert weights: both float32, or both bfloat16
  if (aoti_torch_get_dtype(gate_up, &gdt) || aoti_torch_get_dtype(down, &ddt) || gdt != ddt ||
      (gdt != aoti_torch_dtype_float32() && gdt != aoti_torch_dtype_bfloat16()))
    return AOTI_TORCH_FAILURE;
  const int64_t sizes[2] = {n, h}, strides[2] = {h, 1};
  if (aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0, ret0))
    return AOTI_TORCH_FAILURE;
  void *px, *pi, *pw, *pg, *pd, *po;
  if (aoti_torch_get_data_ptr(x, &px) || aoti_torch_get_data_ptr(ids, &pi) || aoti_torch_get_data_ptr(weights, &pw) ||
      aoti_torch_get_data_ptr(gate_up, &pg) || aoti_torch_get_data_ptr(down, &pd) || aoti_torch_get_data_ptr(*ret0, &po))
    return AOTI_TORCH_FAILURE;
  if (gdt == aoti_torch_dtype_bfloat16())
    metrale_routed_experts_bf16(static_cast<const float*>(px), static_cast<const int64_t*>(pi),
                                static_cast<const float*>(pw), static_cast<const uint16_t*>(pg),
                                static_cast<const uint16_t*>(pd), static_cast<float*>(po), n, k, e, h, i2 / 2);
  else
    metrale_routed_experts(static_cast<const float*>(px), static_cast<const int64_t*>(pi), static_cast<const float*>(pw),
                           static_cast<const float*>(pg), static_cast<const float*>(pd), static_cast<float*>(po),
                           n, k, e, h, i2 / 2);
  return AOTI_TORCH_SUCCESS;
}
