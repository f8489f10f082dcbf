// The register tiles of metrale's CPU matrix kernels (`cpu_moe.cpp`, `cpu_linear.cpp`): rows of
// float32 inputs times a weight matrix B [K, C] held in panels, every output one in-order chain
// of fused multiply-adds over k, from zero.
//
// Panels: B's columns in groups of PANEL, each group's K rows stored one after another, so
// element (k, c) lies at ((c / PANEL) * K + k) * PANEL + c % PANEL (`cpu_panels.pack_panels`).
// A tile walks k through contiguous memory. In B's own row-major layout it walked with a
// stride of C values, and for the tiny target's C (128, 256, 2048) every row of a tile's
// columns fell into the same few L1 sets, so each step of k missed L1. Measured with AVX2 on
// the LM head's shape (32 rows x 128 by 128 x 2048, bfloat16 weights): 322 us row-major, 197
// us in panels; inductor's GEMM template 416 us, torch's `linear` 249 us.
//
// A tile is m input rows (at most R) by nv vectors of W columns (at most widest[m]): m·nv
// accumulators, sized to the ISA's registers. Its shape only sets how many chains run at once,
// so a row's bits do not depend on the other rows of a call, on the tile's shape or on the
// vector width (the same on AVX-512 and AVX2). Weights are float32, or bfloat16 bits widened
// exactly as they are loaded.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu_simd.h"

namespace metrale_tiles {
namespace simd = metrale_simd;
using simd::vec;
using simd::W;

constexpr int64_t PANEL = 16;  // columns a panel: one AVX-512 vector, two AVX2 ones
#if defined(__AVX512F__)
// 32 registers: up to 16 accumulators (eight rows by two vectors), the weights' vectors and the
// broadcast input. Eight rows rather than four widen each bfloat16 weight they load for twice
// the multiply-adds; measured against four (AVX-512, bfloat16 weights, best of 9, the same
// bits): the tiny target's routed experts of 4 layers at 26 rows 254 -> 228 us and 32 rows
// 308 -> 274 us, a step's projections (LM head and 4 layers) at 8 rows 88 -> 77 us, 16 rows
// 170 -> 150, 26 rows 275 -> 245, 32 rows 337 -> 296, 64 rows 666 -> 584; one row unchanged.
constexpr int R = 8;  // rows a tile, at most
constexpr int widest[R + 1] = {0, 8, 4, 2, 2, 2, 2, 2, 2};
#else
// AVX2's 16 registers: up to 12 accumulators, the weights' vectors (two, or four with three
// rows, one of them read again from memory) and the broadcast input
constexpr int R = 6;
constexpr int widest[R + 1] = {0, 8, 4, 4, 2, 2, 2};
#endif
constexpr int MAX_NV = widest[1];  // vectors of output columns a tile, at most (a one-row tile's)

inline vec loadw(const float* p) { return simd::load(p); }
inline vec loadw(const uint16_t* p) { return simd::load_bf16(p); }  // bfloat16 bits, widened

// out[r][0..W·NV) = sum over k = 0..K-1, in order, of a[r][k] * B[k][c0..c0 + W·NV), B in panels
template <int M, int NV, typename T>
inline void tile(const float* const* a, const T* B, int64_t c0, int64_t K, float* const* out) {
  const T* w[NV];  // each vector's column group, at k = 0
  for (int v = 0; v < NV; ++v) {
    const int64_t c = c0 + W * v;
    w[v] = B + (c / PANEL) * K * PANEL + c % PANEL;
  }
  const float* x[M];
  for (int r = 0; r < M; ++r) x[r] = a[r];
  vec acc[M][NV];
  for (int r = 0; r < M; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = simd::zero();
  for (int64_t k = 0; k < K; ++k) {
    vec wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = loadw(w[v] + k * PANEL);
    for (int r = 0; r < M; ++r) {
      const vec s = simd::set1(x[r][k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = simd::fmadd(s, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int v = 0; v < NV; ++v) simd::store(out[r] + W * v, acc[r][v]);
}

// tile<M, nv> for nv a power of two up to NV (only the tiles of widest's sizes are compiled)
template <int M, int NV, typename T>
inline void tile_nv(int nv, const float* const* a, const T* B, int64_t c0, int64_t K, float* const* out) {
  if constexpr (NV > 1)
    if (nv < NV) return tile_nv<M, NV / 2>(nv, a, B, c0, K, out);
  tile<M, NV>(a, B, c0, K, out);
}

// tile<m, nv>(...) for 1 <= m <= M
template <int M, typename T>
inline void tile_rows(int m, int nv, const float* const* a, const T* B, int64_t c0, int64_t K, float* const* out) {
  if constexpr (M > 1)
    if (m < M) return tile_rows<M - 1>(m, nv, a, B, c0, K, out);
  tile_nv<M, widest[M]>(nv, a, B, c0, K, out);
}

// columns [c0, c0 + W·nv) of out = a · B for m rows, nv = widest[m] halved until the tile ends
// within `cols` (a whole number of vectors); out[r] points at column c0; returns the columns done
template <typename T>
inline int tile_m(int m, int64_t c0, int64_t cols, const float* const* a, const T* B, int64_t K,
                  float* const* out) {
  int nv = widest[m];
  while (nv > 1 && c0 + W * nv > cols) nv /= 2;
  tile_rows<R>(m, nv, a, B, c0, K, out);
  return W * nv;
}

}  // namespace metrale_tiles
