// The small ops of an eager pass of a few rows (decode, verify and draft), float32, AVX-512 or AVX2
// with FMA: RMSNorm, and the rotary embedding of queries and keys with the keys' and values' write
// to the KV cache. In torch each is a chain of small ops, about 5-10 us a call in an eager round of
// about 1,900; a compiled round fuses them into its neighbours and keeps torch's.
//
// Single-threaded: a row is a few hundred floats, less than a fork of the thread pool costs.

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "vec.h"

namespace {

using namespace dflow_rt_cpu;

// x [..., n], weight [n]: weight * (x / sqrt(mean(x^2) + eps)) per row, in the HF order (the
// normalised row in float32, then times the weight); squares summed lane by lane, then a fixed tree.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "rms_norm: weight [", n, "], got ", weight.sizes());
  const at::Tensor xs = x.contiguous(), ws = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = n ? x.numel() / n : 0;
  const float* w = ws.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = xs.data_ptr<float>() + r * n;
    float* y = out.data_ptr<float>() + r * n;
    Vec acc = vzero();
    for (int64_t j = 0; j < n; j += kLanes) {
      const Vec v = vload(in + j, std::min(kLanes, n - j));
      acc = vfma(v, v, acc);
    }
    const Vec scale = vset(1.0f / std::sqrt(vsum(acc) / static_cast<float>(n) + static_cast<float>(eps)));
    for (int64_t j = 0; j < n; j += kLanes) {
      const int64_t m = std::min(kLanes, n - j);
      vstore(y + j, vmul(vload(w + j, m), vmul(vload(in + j, m), scale)), m);
    }
  }
  return out;
}

// y = x * cos + roll(x, D / 2) * signed_sin over one head of D floats (`layers.apply_rope`): the same
// three roundings as torch's ops (no fused multiply-add: -ffp-contract=off), so bit-identical.
inline void rotate(const float* x, const float* c, const float* s, float* y, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) y[d] = x[d] * c[d] + x[d + half] * s[d];
  for (int64_t d = half; d < D; ++d) y[d] = x[d] * c[d] + x[d - half] * s[d];
}

// q [b, n, H, D], k and v [b, n, KV, D]; cos and signed_sin [b, 1, n, D] (`layers.Rotary`); k_cache and
// v_cache [b, KV, L, D]; positions [b, n], each in [0, L); unit strides along D. Rotates k into k_cache
// and copies v into v_cache at positions (every row of the cache, in order: the batched round's write),
// and returns the rotated q as [b, H, n, D] stored as [b, n, H, D] (what the attention takes).
at::Tensor rope_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& positions) {
  const int64_t b = q.size(0), n = q.size(1), H = q.size(2), D = q.size(3), KV = k.size(2), L = k_cache.size(2);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == b && k.size(1) == n &&
              k.size(3) == D && D % 2 == 0, "rope_write: q [b, n, H, D], k and v [b, n, KV, D], D even");
  TORCH_CHECK(cos.dim() == 4 && cos.sizes() == sin.sizes() && cos.size(0) == b && cos.size(2) == n && cos.size(3) == D,
              "rope_write: cos and sin [b, 1, n, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == b &&
              k_cache.size(1) == KV && k_cache.size(3) == D, "rope_write: caches [b, KV, L, D]");
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == b && positions.size(1) == n &&
              positions.scalar_type() == at::kLong, "rope_write: positions int64 [b, n]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &cos, &sin, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(3) == 1, "rope_write: float32, unit stride along D");
  }
  at::Tensor out = at::empty({b, n, H, D}, q.options());
  const at::Tensor pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>(), *op = out.data_ptr<float>();
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = p[r * n + j];
      TORCH_CHECK(at >= 0 && at < L, "rope_write: position ", at, " outside the cache's ", L);
      const float* c = cp + r * cos.stride(0) + j * cos.stride(2);
      const float* s = sp + r * sin.stride(0) + j * sin.stride(2);
      for (int64_t h = 0; h < H; ++h) {
        rotate(qp + r * q.stride(0) + j * q.stride(1) + h * q.stride(2), c, s, op + ((r * n + j) * H + h) * D, D);
      }
      for (int64_t h = 0; h < KV; ++h) {
        const int64_t src = r * k.stride(0) + j * k.stride(1) + h * k.stride(2);
        const int64_t dst_k = r * k_cache.stride(0) + h * k_cache.stride(1) + at * k_cache.stride(2);
        const int64_t dst_v = r * v_cache.stride(0) + h * v_cache.stride(1) + at * v_cache.stride(2);
        const int64_t src_v = r * v.stride(0) + j * v.stride(1) + h * v.stride(2);
        rotate(kp + src, c, s, kc + dst_k, D);
        std::copy(vp + src_v, vp + src_v + D, vc + dst_v);
      }
    }
  }
  return out.transpose(1, 2);
}

}  // namespace

// The schema is defined on the Python side (dflow_rt/kernels/cpu/ops.py).
TORCH_LIBRARY_IMPL(dflow_rt, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_write", &rope_write);
}
