// metrale::routed_experts on x86 CPUs with AVX-512: the routed experts of a MoE layer for the
// rows of a compiled step, as AOTInductor packages call it (`plugins/cpu_moe.py`).
//
//   y[n] = sum_j weights[n, j] * D_e (silu(g) * u),  [g; u] = GU_e x[n],  e = ids[n, j]
//
// gate_up [E, H, 2I] (gate columns [0, I), up columns [I, 2I)), down [E, I, H], x [N, H],
// ids and weights [N, k], all contiguous, float32 (ids int64).
//
// The (row, slot) pairs are grouped by expert, so an expert's weights are read once per call
// for all of its pairs, and up to four pairs share each load in registers: a tile keeps eight
// accumulators (four pairs x 32 columns, two x 64, or one pair x 128). Every output element is
// one chain of fused multiply-adds over its input features, in order, from zero, whatever the
// tile's shape: a row's bits depend on its own input and experts only, never on the other rows
// of the call (the batched step's contract). A row's pairs are summed in slot order.

#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

namespace {
constexpr int R = 4;       // pairs per tile
constexpr int MAX_NV = 8;  // 16-float vectors of output columns per tile, at most

// e^x on 16 lanes: Cody-Waite reduction by ln 2, degree-6 Taylor polynomial (|rel err| < 2e-7)
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(-0.693145751953125f), x);
  r = _mm512_fmadd_ps(k, _mm512_set1_ps(-1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// out[r][0..16·NV) = sum over k = 0..K-1, in order, of a[r][k] * W[k][0..16·NV) (W's rows ldw
// apart): one fused multiply-add per k into each output, whatever M and NV, so a row's bits do
// not depend on M or NV (which only set how many chains run at once: M·NV of them)
template <int M, int NV>
inline void tile(const float* const* a, const float* W, int64_t ldw, int64_t K, float* const* out) {
  __m512 acc[M][NV];
  for (int r = 0; r < M; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = W + k * ldw;
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_ps(w + 16 * v);
    for (int r = 0; r < M; ++r) {
      const __m512 s = _mm512_set1_ps(a[r][k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(s, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[r] + 16 * v, acc[r][v]);
}

template <int M>
inline void tile_nv(int nv, const float* const* a, const float* W, int64_t ldw, int64_t K, float* const* out) {
  switch (nv) {
    case 8: return tile<M, 8>(a, W, ldw, K, out);
    case 4: return tile<M, 4>(a, W, ldw, K, out);
    case 2: return tile<M, 2>(a, W, ldw, K, out);
    default: return tile<M, 1>(a, W, ldw, K, out);
  }
}

// columns [c0, c0 + 16·nv) of out = a · W for m rows, nv as wide as `want` allows within `cols`
inline int tile_m(int m, int want, int64_t c0, int64_t cols, const float* const* a, const float* W,
                  int64_t ldw, int64_t K, float* const* out) {
  int nv = want;
  while (nv > 1 && c0 + 16 * nv > cols) nv /= 2;
  switch (m) {
    case 4: tile_nv<4>(nv, a, W, ldw, K, out); break;
    case 3: tile_nv<3>(nv, a, W, ldw, K, out); break;
    case 2: tile_nv<2>(nv, a, W, ldw, K, out); break;
    default: tile_nv<1>(nv, a, W, ldw, K, out); break;
  }
  return 16 * nv;
}
}  // namespace

extern "C" void metrale_routed_experts(const float* x, const int64_t* ids, const float* wts,
                                       const float* gate_up /*[E, H, 2I]*/, const float* down /*[E, I, H]*/,
                                       float* out /*[N, H]*/, int64_t N, int64_t K, int64_t E,
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
  float gate[R][16 * MAX_NV], up[R][16 * MAX_NV];
  const float* a[R];
  float* o[R];
  float* o2[R];
  for (int64_t e = 0; e < E; ++e) {
    const int64_t lo = start[e], hi = start[e + 1];
    if (lo == hi) continue;
    // eight accumulators a tile: 4 pairs x 2 vectors, 2 x 4, or 1 x 8 for an expert of one pair
    const int want = hi - lo >= 3 ? 2 : (hi - lo == 2 ? 4 : 8);
    const float* gu = gate_up + e * H * I2;
    for (int64_t b = lo; b < hi; b += R) {
      const int m = static_cast<int>(std::min<int64_t>(R, hi - b));
      for (int r = 0; r < m; ++r) {
        a[r] = x + (order[b + r] / K) * H;
        o[r] = gate[r];
        o2[r] = up[r];
      }
      for (int64_t c0 = 0; c0 < I;) {  // a column tile of gate and up
        tile_m(m, want, c0, I, a, gu + c0, I2, H, o);
        const int w = tile_m(m, want, c0, I, a, gu + I + c0, I2, H, o2);
        for (int r = 0; r < m; ++r)
          for (int c = 0; c < w; c += 16) {  // silu(g) * u
            const __m512 g = _mm512_loadu_ps(gate[r] + c), u = _mm512_loadu_ps(up[r] + c);
            const __m512 sg = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            _mm512_storeu_ps(act.data() + (b + r) * I + c0 + c, _mm512_mul_ps(sg, u));
          }
        c0 += w;
      }
    }
    const float* dn = down + e * I * H;
    for (int64_t b = lo; b < hi; b += R) {
      const int m = static_cast<int>(std::min<int64_t>(R, hi - b));
      for (int64_t c0 = 0; c0 < H;) {
        for (int r = 0; r < m; ++r) {
          a[r] = act.data() + (b + r) * I;
          o[r] = y.data() + order[b + r] * H + c0;
        }
        c0 += tile_m(m, want, c0, H, a, dn + c0, H, I, o);
      }
    }
  }
  for (int64_t n = 0; n < N; ++n)  // a row's pairs summed in slot order
    for (int64_t h = 0; h < H; h += 16) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t j = 0; j < K; ++j)
        s = _mm512_fmadd_ps(_mm512_set1_ps(wts[n * K + j]), _mm512_loadu_ps(y.data() + (n * K + j) * H + h), s);
      _mm512_storeu_ps(out + n * H + h, s);
    }
}


// The C shim AOTInductor's wrapper calls for metrale::routed_experts (its name is the op's,
// prefixed as aten ops' shims are): checks the layout, allocates the output, runs the kernel.
extern "C" AOTITorchError aoti_torch_cpu_routed_experts(AtenTensorHandle x, AtenTensorHandle ids,
                                                        AtenTensorHandle weights, AtenTensorHandle gate_up,
                                                        AtenTensorHandle down, AtenTensorHandle* ret0) {
  int64_t dim = 0;
  if (aoti_torch_get_dim(x, &dim) || dim != 2 || aoti_torch_get_dim(gate_up, &dim) || dim != 3)
    return AOTI_TORCH_FAILURE;
  int64_t *xs, *is, *gs;
  if (aoti_torch_get_sizes(x, &xs) || aoti_torch_get_sizes(ids, &is) || aoti_torch_get_sizes(gate_up, &gs))
    return AOTI_TORCH_FAILURE;
  const int64_t n = xs[0], h = xs[1], k = is[1], e = gs[0], i2 = gs[2];
  if (gs[1] != h || i2 % 32 != 0 || h % 16 != 0 || is[0] != n) return AOTI_TORCH_FAILURE;
  const int64_t sizes[2] = {n, h}, strides[2] = {h, 1};
  if (aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0, ret0))
    return AOTI_TORCH_FAILURE;
  void *px, *pi, *pw, *pg, *pd, *po;
  if (aoti_torch_get_data_ptr(x, &px) || aoti_torch_get_data_ptr(ids, &pi) || aoti_torch_get_data_ptr(weights, &pw) ||
      aoti_torch_get_data_ptr(gate_up, &pg) || aoti_torch_get_data_ptr(down, &pd) || aoti_torch_get_data_ptr(*ret0, &po))
    return AOTI_TORCH_FAILURE;
  metrale_routed_experts(static_cast<const float*>(px), static_cast<const int64_t*>(pi), static_cast<const float*>(pw),
                         static_cast<const float*>(pg), static_cast<const float*>(pd), static_cast<float*>(po),
                         n, k, e, h, i2 / 2);
  return AOTI_TORCH_SUCCESS;
}
