// y = x @ w.T for a few rows of x (decode and verify passes), float32, AVX-512 or AVX2 with FMA.
//
// At 1-16 rows a product is mostly a read of w: each block of rows of w comes from memory once and
// is dotted with every row of x from L1. A block of several rows is prefetched while the block before
// it is used; a decode step on AVX-512 streams one row at a time (bench/cpu_gemv.py has the rates
// against the GEMM library, bench/gemv_tiles.py the tile shapes). Every
// output element is summed in one fixed order (one lane per k modulo the vector width, then a fixed
// tree), independent of the row count and the thread split: a row's result is bit-identical in a
// 1-row step and in a 4-row verify pass.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace {

// The vector type and the four operations a tile needs, per instruction set. AVX2 has 16 vector
// registers against AVX-512's 32, so its tiles are smaller (`gemv` picks them).
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p, int64_t n) {  // the first n (<= kLanes) floats at p, zeros after
  return n == kLanes ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p, int64_t n) {
  if (n == kLanes) return _mm256_loadu_ps(p);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {  // halves, then pairs, then the last two: one fixed tree
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#else
#error "cpu_gemv.cpp needs AVX-512 or AVX2 with FMA (cpu_gemv.py builds it only there)"
#endif

// y[m0:m0+RX, n0:n0+RW]: one accumulator per element, summed over k lane by lane, then a fixed tree.
// The first tile of a block of w also prefetches the next block (`ahead` rows of it) into L1.
template <int RX, int RW>
inline void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
                 int64_t ahead) {
  Vec acc[RX][RW];
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j) acc[i][j] = vzero();
  auto step = [&](int64_t k, int64_t n) {
    for (int64_t j = 0; j < ahead; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + RW + j) * K + k), _MM_HINT_T0);
    Vec wv[RW];
    for (int j = 0; j < RW; ++j) wv[j] = vload(w + (n0 + j) * K + k, n);
    for (int i = 0; i < RX; ++i) {
      const Vec xv = vload(x + (m0 + i) * K + k, n);
      for (int j = 0; j < RW; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  };
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) step(k, kLanes);
  if (k < K) step(k, K - k);
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j) y[(m0 + i) * N + n0 + j] = vsum(acc[i][j]);
}

// Rows [0, M) of x against w[n0:n0+RW]: RX rows of x at a time, then one at a time.
template <int RX, int RW>
inline void block(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                  int64_t ahead) {
  int64_t m = 0;
  for (; m + RX <= M; m += RX) tile<RX, RW>(x, w, y, K, N, m, n0, m == 0 ? ahead : 0);
  for (; m < M; ++m) tile<1, RW>(x, w, y, K, N, m, n0, m == 0 ? ahead : 0);
}

// Blocks of RW rows of w split over threads; the last N % RW rows one at a time. A block of several
// rows prefetches the next; a single row of w at a time is one sequential stream, which the hardware
// prefetcher follows best alone (bench/gemv_tiles.py).
template <int RX, int RW>
void product(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / RW;
  at::parallel_for(0, blocks, 64 / RW, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) block<RX, RW>(x, w, y, M, K, N, b * RW, RW > 1 && b + 1 < end ? RW : 0);
  });
  for (int64_t n = blocks * RW; n < N; ++n) block<RX, 1>(x, w, y, M, K, N, n, 0);
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
  // Tile shapes (rows of x by rows of w) from bench/cpu_gemv.py and bench/gemv_tiles.py; any shape
  // sums an element alike.
#if defined(__AVX512F__)
  if (M == 1) product<1, 1>(xp, wp, yp, M, K, N);
  else if (M < 4) product<2, 8>(xp, wp, yp, M, K, N);
  else product<4, 6>(xp, wp, yp, M, K, N);
#else
  if (M == 1) product<1, 8>(xp, wp, yp, M, K, N);
  else if (M < 4) product<2, 4>(xp, wp, yp, M, K, N);
  else product<4, 2>(xp, wp, yp, M, K, N);
#endif
  return y;
}

}  // namespace

// The schema is defined on the Python side (dflow_rt/models/cpu_gemv.py), with its shape function.
TORCH_LIBRARY_IMPL(dflow_rt, CPU, m) {
  m.impl("gemv", &gemv);
}
