// y = x @ w.T for a few rows of x (decode and verify passes), float32, AVX-512.
//
// At 1-16 rows a product is mostly a read of w: each block of 4 rows of w comes from memory once,
// prefetched while the block before it is used, and is dotted with every row of x from L1
// (bench/cpu_gemv.py has the rates against the GEMM library). Every
// output element is summed in one fixed order (16 lanes over k, then a fixed tree), independent of
// the row count and the thread split: a row's result is bit-identical in a 1-row step and in a
// 4-row verify pass.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace {

constexpr int64_t kRowsOfX = 4;  // a tile: 4 rows of x by 4 rows of w, 16 accumulators of 16 lanes
constexpr int64_t kRowsOfW = 4;

// y[m0:m0+RX, n0:n0+RW]: one accumulator per element, summed over k in 16 lanes, then a fixed tree.
// The first tile of a block of w also prefetches the next block (`ahead` rows of it) into L1.
template <int RX, int RW>
inline void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
                 int64_t ahead) {
  __m512 acc[RX][RW];
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j) acc[i][j] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __mmask16 mask) {
    for (int64_t j = 0; j < ahead; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + RW + j) * K + k), _MM_HINT_T0);
    __m512 wv[RW];
    for (int j = 0; j < RW; ++j) wv[j] = _mm512_maskz_loadu_ps(mask, w + (n0 + j) * K + k);
    for (int i = 0; i < RX; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (m0 + i) * K + k);
      for (int j = 0; j < RW; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  };
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) step(k, static_cast<__mmask16>(0xFFFF));
  if (k < K) step(k, static_cast<__mmask16>((1u << (K - k)) - 1u));
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j) y[(m0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// Rows [0, M) of x against w[n0:n0+RW]: 4 rows of x at a time, then one at a time.
template <int RW>
inline void block(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                  int64_t ahead) {
  int64_t m = 0;
  for (; m + kRowsOfX <= M; m += kRowsOfX) tile<kRowsOfX, RW>(x, w, y, K, N, m, n0, m == 0 ? ahead : 0);
  for (; m < M; ++m) tile<1, RW>(x, w, y, K, N, m, n0, m == 0 ? ahead : 0);
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "gemv: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "gemv: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / kRowsOfW;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      block<kRowsOfW>(xp, wp, yp, M, K, N, b * kRowsOfW, b + 1 < end ? kRowsOfW : 0);
  });
  for (int64_t n = blocks * kRowsOfW; n < N; ++n) block<1>(xp, wp, yp, M, K, N, n, 0);  // the last rows of w
  return y;
}

}  // namespace

// The schema is defined on the Python side (dflow_rt/models/cpu_gemv.py), with its shape function.
TORCH_LIBRARY_IMPL(dflow_rt, CPU, m) {
  m.impl("gemv", &gemv);
}
