// Attention of a few query rows over the static KV cache (decode, verify and draft passes), float32,
// AVX-512 or AVX2 with FMA.
//
// A query row reads only the keys it sees, 0..start+j (causal: decode and verify) or 0..start+B-1
// (the drafter's bidirectional block), so it costs its own context; SDPA over the dense mask
// computes and discards every position of the length bucket, and at 2-4 query rows it cost 2.3x
// its 1-row time. Each row is summed in one fixed order (a score lane by lane over the head
// dimension, then a fixed tree; the weighted values over keys in order), so its result is
// bit-identical whatever rows share the call and whatever the bucket's length: a verify pass
// reproduces plain steps exactly.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "vec.h"

namespace {

using namespace dflow_rt_cpu;

struct Rows {  // keys or values of one (batch row, kv head): position i at p + i * stride
  const float* p;
  int64_t stride;
  const float* at(int64_t i) const { return p + i * stride; }
};

// The lanes of vector c of a row of d floats (C vectors, the last holding `tail` of them).
template <int C>
inline int64_t lanes(int c, int64_t tail) { return c == C - 1 ? tail : kLanes; }

// q . key lane by lane (summed across lanes by `vsums`).
template <int C>
inline Vec dot(const Vec (&q)[C], const float* key, int64_t tail) {
  Vec acc = vmul(q[0], vload(key, lanes<C>(0, tail)));
#pragma GCC unroll 16
  for (int c = 1; c < C; ++c) acc = vfma(q[c], vload(key + c * kLanes, lanes<C>(c, tail)), acc);
  return acc;
}

// out_r = softmax(q_r . k_i) v over keys 0..n-1 for R query rows that see the same keys (query heads
// of one kv head at one position), each q_r of C vectors, the last holding `tail` floats: every key and
// value is read once for the R rows, and a row's arithmetic is its own, in the same order whatever R.
// `w` is scratch for R rows of weights, `ws` floats apart (n rounded up to whole vectors).
template <int C, int R>
void attend_rows(const float* const (&q)[R], Vec scale, int64_t tail, Rows k, Rows v, int64_t n, float* w,
                 int64_t ws, float* const (&out)[R]) {
  Vec qv[R][C];  // scaled into log2 units: the weights are powers of 2
  Vec top[R];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) qv[r][c] = vmul(vload(q[r] + c * kLanes, lanes<C>(c, tail)), scale);
    top[r] = vset(-std::numeric_limits<float>::infinity());
  }
  for (int64_t i = 0; i < n; i += kLanes) {  // kLanes keys at a time: read from cache once, then from L1
    const int64_t m = std::min(kLanes, n - i);
    for (int r = 0; r < R; ++r) {
      Vec part[kLanes];
      if (m == kLanes) {
#pragma GCC unroll 16
        for (int u = 0; u < kLanes; ++u) part[u] = dot(qv[r], k.at(i + u), tail);
      } else {
        for (int u = 0; u < kLanes; ++u) part[u] = u < m ? dot(qv[r], k.at(i + u), tail) : vzero();
      }
      vstore(w + r * ws + i, vsums(part));
      top[r] = vmax(top[r], vload_or(w + r * ws + i, m, -std::numeric_limits<float>::infinity()));
    }
  }
  float total[R];
  for (int r = 0; r < R; ++r) {
    float* wr = w + r * ws;
    const Vec shift = vset(vmaxall(top[r]));
    Vec sum = vzero();
    for (int64_t i = 0; i < n; i += kLanes) {  // the key at `top` weighs 1: the total is at least 1
      const int64_t m = std::min(kLanes, n - i);
      vstore(wr + i, vexp2(vsub(vload(wr + i, m), shift)));
      sum = vadd(sum, vload(wr + i, m));  // lanes past n read back as zeros
    }
    total[r] = vsum(sum);
  }
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  for (int64_t i = 0; i < n; ++i) {
    Vec vv[C];
    for (int c = 0; c < C; ++c) vv[c] = vload(v.at(i) + c * kLanes, lanes<C>(c, tail));
    for (int r = 0; r < R; ++r) {
      const Vec p = vset(w[r * ws + i]);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(p, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore(out[r] + c * kLanes, vdiv(acc[r][c], vset(total[r])), lanes<C>(c, tail));
}

constexpr int kTile = 4;  // query rows per pass over the keys: 4 rows of 4 vectors fit AVX-512's registers

// Query heads [h, h + R) of batch row r at slot j: one pass of `attend_rows`.
template <int C, int R>
void attend_tile(const at::Tensor& q, Vec scale, Rows k, Rows v, int64_t n, float* w, int64_t ws, at::Tensor& out,
                 int64_t r, int64_t h, int64_t j) {
  const float* qs[R];
  float* outs[R];
  const int64_t heads = q.size(1), B = q.size(2), D = q.size(3);
  for (int i = 0; i < R; ++i) {
    qs[i] = q.data_ptr<float>() + r * q.stride(0) + (h + i) * q.stride(1) + j * q.stride(2);
    outs[i] = out.data_ptr<float>() + ((r * B + j) * heads + h + i) * D;
  }
  attend_rows<C, R>(qs, scale, D - (C - 1) * kLanes, k, v, n, w, ws, outs);
}

// One task per (batch row, kv head, slot): its query heads in tiles of at most kTile rows.
template <int C>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& starts,
            bool causal, at::Tensor& out) {
  const int64_t kv_heads = k.size(1), B = q.size(2), group = q.size(1) / kv_heads, L = k.size(2);
  const Vec scale = vset(static_cast<float>(M_LOG2E / std::sqrt(static_cast<double>(q.size(3)))));
  const int64_t ws = (L + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, q.size(0) * kv_heads * B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kTile * ws);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / (kv_heads * B), g = t / B % kv_heads, j = t % B;
      const Rows kr{k.data_ptr<float>() + r * k.stride(0) + g * k.stride(1), k.stride(2)};
      const Rows vr{v.data_ptr<float>() + r * v.stride(0) + g * v.stride(1), v.stride(2)};
      const int64_t n = std::min(starts[r] + (causal ? j : B - 1) + 1, L);
      for (int64_t h = g * group; h < (g + 1) * group; h += kTile) {
        switch (std::min<int64_t>(kTile, (g + 1) * group - h)) {
          case 1: attend_tile<C, 1>(q, scale, kr, vr, n, w.data(), ws, out, r, h, j); break;
          case 2: attend_tile<C, 2>(q, scale, kr, vr, n, w.data(), ws, out, r, h, j); break;
          case 3: attend_tile<C, 3>(q, scale, kr, vr, n, w.data(), ws, out, r, h, j); break;
          default: attend_tile<C, 4>(q, scale, kr, vr, n, w.data(), ws, out, r, h, j); break;
        }
      }
    }
  });
}

// q [b, heads, B, d] (queries at positions start[r] + j), k and v [b, kv_heads, L, d] (cache views,
// strided along L; heads a multiple of kv_heads, as SDPA's enable_gqa); d up to 16 vectors.
// The result is [b, heads, B, d] stored as [b, B, heads, d]: the output projection's input as is.
at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& start,
                           bool causal) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
              k.size(3) == q.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 && k.size(2) > 0,
              "cache_attention: q [b, heads, B, d], k and v [b, kv_heads, L, d], heads a multiple of kv_heads");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "cache_attention: float32 only");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "cache_attention: unit stride along d");
  TORCH_CHECK(start.dim() == 1 && start.size(0) == q.size(0) && start.scalar_type() == at::kLong,
              "cache_attention: start int64 [b]");
  const int64_t D = q.size(3), chunks = (D + kLanes - 1) / kLanes;
  std::vector<int64_t> starts(q.size(0));
  const auto s = start.accessor<int64_t, 1>();
  for (int64_t r = 0; r < q.size(0); ++r) {
    TORCH_CHECK(s[r] >= 0, "cache_attention: negative start ", s[r]);
    starts[r] = s[r];
  }
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), D}, q.options());
  TORCH_CHECK(D > 0 && (chunks & (chunks - 1)) == 0 && chunks <= 16,
              "cache_attention: d must fill 1, 2, 4, 8 or 16 vectors of ", kLanes, " floats, got ", D);
  switch (chunks) {
    case 1: attend<1>(q, k, v, starts, causal, out); break;
    case 2: attend<2>(q, k, v, starts, causal, out); break;
    case 4: attend<4>(q, k, v, starts, causal, out); break;
    case 8: attend<8>(q, k, v, starts, causal, out); break;
    default: attend<16>(q, k, v, starts, causal, out); break;
  }
  return out.transpose(1, 2);
}

}  // namespace

// The schema is defined on the Python side (dflow_rt/kernels/cpu/ops.py), with its shape function.
TORCH_LIBRARY_IMPL(dflow_rt, CPU, m) { m.impl("cache_attention", &cache_attention); }
