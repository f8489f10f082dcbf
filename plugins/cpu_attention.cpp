// metrale::pooled_attention on x86 CPUs with AVX-512 or AVX2 + FMA: the attention of a compiled
// step's rows, each over its own sequence's cache in a pool, as AOTInductor packages call it
// (`plugins/cpu_attention.py`).
//
//   out[t, h] = sum_{j < L} p_j V[b, j, h/g],  p = softmax_j(scale · q[t, h] · K[b, h/g, :, j]),
//   b = seq[t], L = last_visible[t] + 1, g = nh / nkv
//
// q [T, nh, hd], K pool [B, nkv, hd, S] (slot-minor: a vector of slots' scores is one FMA per
// feature), V pool [B, S, nkv, hd], seq and last_visible [T] int64, all contiguous, float32.
//
// metrale::pooled_tree_attention is the same with hide [T] int64: bit d of hide[t] hides slot
// last_visible[t] - 1 - d from row t (a draft tree's verify rows: a node sees the slots before
// the tree's first draft, then its ancestors only). The row's visible slots are taken in slot
// order as if they were its first slots: every reduction below runs over that order, so a tree
// node's row has the bits of the same node's row in a chain verify of its path, whose ancestors
// are the slots just before it.
//
// Only a row's L visible slots are read, where inductor's code for the masked math gathers and
// multiplies all S slots of the sequence: the work is the sequence's length, not its pool's
// slot count. Every score is one in-order chain of fused multiply-adds over the features; the
// maximum, the exponentials' sum (16 partial sums, slot j into sum j mod 16 in slot order, then
// the 16 in a fixed order) and the weighted values (slots in order) run over the row's own
// slots only, so a row's bits depend on its query, its sequence's first L slots and L — never
// on the other rows of the call, the pool's slot count or its sequence count (the batched
// step's contract). Slots go in blocks of 16 whatever the vector width (one 16-float vector
// with AVX-512, two 8-float ones with AVX2), so the bits are the same on either ISA. A KV
// head's query heads go two at a time through its K rows (each load of K serving both heads'
// scores) and then its V rows, up to four blocks' scores at once but only the blocks that hold
// visible slots: more independent chains of fused multiply-adds, each in the same order.
// Measured against one head at a time over four blocks whatever L (AVX-512, the tiny
// target's 4 heads, 2 KV heads, hd 32, 32 rows of a 64-sequence pool, 4 layers, best of 9,
// the same bits): 64 slots a sequence, up to 8 visible 68 -> 31 us, up to 20 72 -> 37, up to
// 37 79 -> 54, up to 64 94 -> 77; 320 slots, up to 260 visible 643 -> 472 us. With AVX2 the
// same build's bits, and 73 -> 32, 79 -> 42, 89 -> 61, 111 -> 94 us at 64 slots.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "cpu_simd.h"

namespace {
namespace simd = metrale_simd;
using simd::vec;
using simd::W;
constexpr int64_t MAX_HD = 256;  // head sizes the kernel takes: 16·k, up to this
constexpr int BLOCK = 16;        // slots a block of scores, and partial sums of the exponentials
constexpr int NB = BLOCK / W;    // vectors a block
constexpr int GROUP = 4;         // blocks of scores computed at once (independent chains), one head
constexpr int GROUP2 = NB == 1 ? 4 : 2;  // the same for two heads at once (AVX2's 16 registers: 2 x 4)
constexpr int ACC = 8;           // vector accumulators of the weighted values at once: 2 heads x 4, 1 x 8

// out[h][0..W·NV) = inv[h] · sum over j = 0..L-1, in order, of p[h][j] · V[j][0..W·NV) (V's rows
// vstride apart) for HB query heads of one KV head at once (they read the same V rows): one
// fused multiply-add per slot into each output, whatever HB and NV (which only set how many
// chains run at once: HB·NV of them)
template <int HB, int NV>
inline void weighted(const float* const* p, const float* V, int64_t vstride, int64_t L, const float* inv,
                     float* const* out, const int64_t* slot) {
  vec o[HB][NV];
  for (int h = 0; h < HB; ++h)
    for (int v = 0; v < NV; ++v) o[h][v] = simd::zero();
  for (int64_t j = 0; j < L; ++j) {
    const float* vj = V + (slot ? slot[j] : j) * vstride;  // slot: the j-th visible slot (tree rows)
    vec vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = simd::load(vj + W * v);
    for (int h = 0; h < HB; ++h) {
      const vec ph = simd::set1(p[h][j]);
      for (int v = 0; v < NV; ++v) o[h][v] = simd::fmadd(ph, vv[v], o[h][v]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int v = 0; v < NV; ++v) simd::store(out[h] + W * v, simd::mul(o[h][v], simd::set1(inv[h])));
}

// the features [c, c + W·nv) of weighted<HB, nv>, nv the widest of ACC / HB, 4, 2 and 1
// vectors within the head's hd features; returns the features done
template <int HB>
inline int64_t weighted_at(int64_t c, const float* const* p, const float* V, int64_t vstride, int64_t hd,
                           int64_t L, const float* inv, float* const* out, const int64_t* slot) {
  float* o[HB];
  for (int h = 0; h < HB; ++h) o[h] = out[h] + c;
  const int64_t left = (hd - c) / W;
  int nv = 1;
  if (left >= ACC / HB) {
    nv = ACC / HB;
    weighted<HB, ACC / HB>(p, V + c, vstride, L, inv, o, slot);
  } else if (left >= 4) {
    nv = 4;
    weighted<HB, 4>(p, V + c, vstride, L, inv, o, slot);
  } else if (left >= 2) {
    nv = 2;
    weighted<HB, 2>(p, V + c, vstride, L, inv, o, slot);
  } else {
    weighted<HB, 1>(p, V + c, vstride, L, inv, o, slot);
  }
  return W * nv;
}

// the scores of HB query heads (of one KV head) over NBLK blocks of slots from j0, into p[h]:
// each slot's score one in-order chain of fused multiply-adds over the features, then scaled;
// their maximum on the visible slots into mx[h]. The heads share each load of K, and only the
// blocks holding visible slots are computed (a group's count sets how many chains run at once,
// never a score's bits).
template <int HB, int NBLK>
inline void scores(const float* const* qh, const float* K, int64_t hd, int64_t S, int64_t j0, int64_t L,
                   float scale, float* const* p, vec* mx) {
  constexpr int NV = NBLK * NB;
  simd::mask m[NV];
  vec acc[HB][NV];
  for (int i = 0; i < NV; ++i) m[i] = simd::tail(L - j0 - W * i);
  for (int h = 0; h < HB; ++h)
    for (int i = 0; i < NV; ++i) acc[h][i] = simd::zero();
  for (int64_t d = 0; d < hd; ++d) {
    vec kd[NV];
    for (int i = 0; i < NV; ++i) kd[i] = simd::maskz_load(m[i], K + d * S + j0 + W * i);
    for (int h = 0; h < HB; ++h) {
      const vec qd = simd::set1(qh[h][d]);
      for (int i = 0; i < NV; ++i) acc[h][i] = simd::fmadd(qd, kd[i], acc[h][i]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int i = 0; i < NV; ++i) {
      acc[h][i] = simd::mul(acc[h][i], simd::set1(scale));
      simd::store(p[h] + j0 + W * i, acc[h][i]);
      mx[h] = simd::mask_max(mx[h], m[i], acc[h][i]);
    }
}

// HB query heads' probabilities over their visible slots, unnormalised: the scores of slots
// 0..L into p[h][0..L), then, with `slot` (the n visible slots of a tree row, in order), the
// visible ones' moved to p[h][0..n) and their maximum taken again; then e^(score - max) of the
// n; 1 / their sum into inv[h]
template <int HB>
void softmax_rows(const float* const* qh, const float* K /*[hd, S]*/, int64_t hd, int64_t S, int64_t L, float scale,
                  float* const* p, float* inv, const int64_t* slot, int64_t n) {
  vec mx[HB];
  for (int h = 0; h < HB; ++h) mx[h] = simd::set1(-INFINITY);
  for (int64_t j0 = 0; j0 < L;) {  // up to GROUP blocks' scores at once, the blocks L needs
    const int64_t blocks = std::min<int64_t>((L - j0 + BLOCK - 1) / BLOCK, HB == 1 ? GROUP : GROUP2);
    if (blocks >= 4)
      scores<HB, 4>(qh, K, hd, S, j0, L, scale, p, mx);
    else if (blocks == 3)
      scores<HB, 3>(qh, K, hd, S, j0, L, scale, p, mx);
    else if (blocks == 2)
      scores<HB, 2>(qh, K, hd, S, j0, L, scale, p, mx);
    else
      scores<HB, 1>(qh, K, hd, S, j0, L, scale, p, mx);
    j0 += blocks * BLOCK;
  }
  if (slot) {
    for (int h = 0; h < HB; ++h) {
      for (int64_t m = 0; m < n; ++m) p[h][m] = p[h][slot[m]];  // slot[m] >= m: in place
      mx[h] = simd::set1(-INFINITY);
      for (int64_t j0 = 0; j0 < n; j0 += W) mx[h] = simd::mask_max(mx[h], simd::tail(n - j0), simd::load(p[h] + j0));
    }
  }
  L = n;
  for (int h = 0; h < HB; ++h) {
    const vec top = simd::set1(simd::reduce_max(mx[h]));
    vec sum[NB];
    for (int i = 0; i < NB; ++i) sum[i] = simd::zero();
    for (int64_t j0 = 0; j0 < L; j0 += BLOCK)
      for (int i = 0; i < NB; ++i) {
        float* pj = p[h] + j0 + W * i;
        const vec e = simd::maskz(simd::tail(L - j0 - W * i), simd::exp(simd::sub(simd::load(pj), top)));
        simd::store(pj, e);
        sum[i] = simd::add(sum[i], e);
      }
    float lanes[BLOCK];
    for (int i = 0; i < NB; ++i) simd::store(lanes + W * i, sum[i]);
    float total = 0.0f;
    for (int i = 0; i < BLOCK; ++i) total += lanes[i];
    inv[h] = 1.0f / total;
  }
}
}  // namespace

extern "C" void metrale_pooled_tree_attention(const float* q, const float* k_pool, const float* v_pool,
                                              const int64_t* seq, const int64_t* last_visible, const int64_t* hide,
                                              float* out, int64_t T, int64_t NH, int64_t NKV, int64_t HD, int64_t S) {
  const int64_t G = NH / NKV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const int64_t ps = S + GROUP * BLOCK;  // a head's scores, with room for a whole group of blocks
  thread_local std::vector<float> buf;   // two heads' scores, then probabilities (kept: no allocation once warm)
  buf.resize(2 * ps);
  float* const ph[2] = {buf.data(), buf.data() + ps};  // written by the scores and the softmax
  const float* const p[2] = {ph[0], ph[1]};           // read by the weighted values
  thread_local std::vector<int64_t> slots;            // a tree row's visible slots, in order
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = seq[t], L = std::min<int64_t>(last_visible[t] + 1, S);
    if (L <= 0) {  // no visible slot (the masked math's row is undefined): zeros
      std::fill(out + t * NH * HD, out + (t + 1) * NH * HD, 0.0f);
      continue;
    }
    const uint64_t hidden = hide ? static_cast<uint64_t>(hide[t]) : 0;
    const int64_t* slot = nullptr;
    int64_t n = L;
    if (hidden) {
      slots.clear();
      for (int64_t j = 0; j < L; ++j) {
        const int64_t d = last_visible[t] - 1 - j;
        if (d < 0 || d > 63 || !((hidden >> d) & 1)) slots.push_back(j);
      }
      slot = slots.data();
      n = static_cast<int64_t>(slots.size());
    }
    for (int64_t kv = 0; kv < NKV; ++kv) {
      const float* K = k_pool + (b * NKV + kv) * HD * S;
      const float* V = v_pool + (b * S * NKV + kv) * HD;
      for (int64_t h0 = kv * G; h0 < (kv + 1) * G; h0 += 2) {  // the group's query heads, two at a time
        const int hb = (kv + 1) * G - h0 >= 2 ? 2 : 1;
        float inv[2];
        float* o[2];
        const float* qh[2];
        for (int i = 0; i < hb; ++i) {
          qh[i] = q + (t * NH + h0 + i) * HD;
          o[i] = out + (t * NH + h0 + i) * HD;
        }
        if (hb == 2)
          softmax_rows<2>(qh, K, HD, S, L, scale, ph, inv, slot, n);
        else
          softmax_rows<1>(qh, K, HD, S, L, scale, ph, inv, slot, n);
        for (int64_t c = 0; c < HD;)
          c += hb == 2 ? weighted_at<2>(c, p, V, NKV * HD, HD, n, inv, o, slot)
                       : weighted_at<1>(c, p, V, NKV * HD, HD, n, inv, o, slot);
      }
    }
  }
}

extern "C" void metrale_pooled_attention(const float* q, const float* k_pool, const float* v_pool,
                                         const int64_t* seq, const int64_t* last_visible, float* out,
                                         int64_t T, int64_t NH, int64_t NKV, int64_t HD, int64_t S) {
  metrale_pooled_tree_attention(q, k_pool, v_pool, seq, last_visible, nullptr, out, T, NH, NKV, HD, S);
}

namespace {
// whether t is a contiguous tensor of `dim` dimensions and `dtype` (its sizes into `sizes`)
bool contiguous(AtenTensorHandle t, int64_t dim, int32_t dtype, int64_t* sizes) {
  int64_t d = 0, *sz, *st;
  int32_t dt = 0;
  if (aoti_torch_get_dim(t, &d) || d != dim || aoti_torch_get_dtype(t, &dt) || dt != dtype ||
      aoti_torch_get_sizes(t, &sz) || aoti_torch_get_strides(t, &st))
    return false;
  int64_t expect = 1;
  for (int64_t i = dim - 1; i >= 0; --i) {
    sizes[i] = sz[i];
    if (sz[i] != 1 && st[i] != expect) return false;
    expect *= sz[i];
  }
  return true;
}
}  // namespace

// The C shims AOTInductor's wrapper calls for metrale::pooled_attention and
// metrale::pooled_tree_attention (their names are the ops', prefixed as aten ops' shims are): check
// the layout, allocate the output [T, nh·hd], run the kernel.
namespace {
AOTITorchError pooled_shim(AtenTensorHandle q, AtenTensorHandle k_pool, AtenTensorHandle v_pool, AtenTensorHandle seq,
                           AtenTensorHandle last_visible, AtenTensorHandle hide, AtenTensorHandle* ret0) {
  const int32_t f32 = aoti_torch_dtype_float32(), i64 = aoti_torch_dtype_int64();
  int64_t qs[3], ks[4], vs[4], ss[1], ls[1], hs[1] = {0};
  if (!contiguous(q, 3, f32, qs) || !contiguous(k_pool, 4, f32, ks) || !contiguous(v_pool, 4, f32, vs) ||
      !contiguous(seq, 1, i64, ss) || !contiguous(last_visible, 1, i64, ls) || (hide && !contiguous(hide, 1, i64, hs)))
    return AOTI_TORCH_FAILURE;
  const int64_t T = qs[0], NH = qs[1], HD = qs[2], NKV = ks[1], S = ks[3];
  if (ks[2] != HD || vs[0] != ks[0] || vs[1] != S || vs[2] != NKV || vs[3] != HD || ss[0] != T || ls[0] != T ||
      (hide && hs[0] != T) || HD % 16 != 0 || HD > MAX_HD || NKV == 0 || NH % NKV != 0)
    return AOTI_TORCH_FAILURE;
  const int64_t sizes[2] = {T, NH * HD}, strides[2] = {NH * HD, 1};
  if (aoti_torch_empty_strided(2, sizes, strides, f32, aoti_torch_device_type_cpu(), 0, ret0))
    return AOTI_TORCH_FAILURE;
  void *pq, *pk, *pv, *ps, *pl, *ph = nullptr, *po;
  if (aoti_torch_get_data_ptr(q, &pq) || aoti_torch_get_data_ptr(k_pool, &pk) || aoti_torch_get_data_ptr(v_pool, &pv) ||
      aoti_torch_get_data_ptr(seq, &ps) || aoti_torch_get_data_ptr(last_visible, &pl) ||
      (hide && aoti_torch_get_data_ptr(hide, &ph)) || aoti_torch_get_data_ptr(*ret0, &po))
    return AOTI_TORCH_FAILURE;
  metrale_pooled_tree_attention(static_cast<const float*>(pq), static_cast<const float*>(pk),
                                static_cast<const float*>(pv), static_cast<const int64_t*>(ps),
                                static_cast<const int64_t*>(pl), static_cast<const int64_t*>(ph),
                                static_cast<float*>(po), T, NH, NKV, HD, S);
  return AOTI_TORCH_SUCCESS;
}
}  // namespace

extern "C" AOTITorchError aoti_torch_cpu_pooled_attention(AtenTensorHandle q, AtenTensorHandle k_pool,
                                                          AtenTensorHandle v_pool, AtenTensorHandle seq,
                                                          AtenTensorHandle last_visible, AtenTensorHandle* ret0) {
  return pooled_shim(q, k_pool, v_pool, seq, last_visible, nullptr, ret0);
}

extern "C" AOTITorchError aoti_torch_cpu_pooled_tree_attention(AtenTensorHandle q, AtenTensorHandle k_pool,
                                                               AtenTensorHandle v_pool, AtenTensorHandle seq,
                                                               AtenTensorHandle last_visible, AtenTensorHandle hide,
                                                               AtenTensorHandle* ret0) {
  return pooled_shim(q, k_pool, v_pool, seq, last_visible, hide, ret0);
}
