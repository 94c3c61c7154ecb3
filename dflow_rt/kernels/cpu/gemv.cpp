// y = x @ w.T for a few rows of x (decode and verify passes), float32, AVX-512 or AVX2 with FMA.
//
// At 1-16 rows a product is mostly a read of w: each block of rows of w comes from memory once and
// is dotted with every row of x from L1. A block of several rows is prefetched while the block before
// it is used; a decode step on AVX-512 streams one row at a time (bench/cpu_gemv.py has the rates
// against the GEMM library, docs/experiments.md the tile shapes). Every
// output element is summed in one fixed order (one lane per k modulo the vector width, then a fixed
// tree), independent of the row count and the thread split: a row's result is bit-identical in a
// 1-row step and in a 4-row verify pass.
#include <cstring>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "vec.h"

namespace {

using namespace dflow_rt_cpu;

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
// prefetcher follows best alone (docs/experiments.md, "GEMV tiles").
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
  // Tile shapes (rows of x by rows of w) from bench/cpu_gemv.py and docs/experiments.md; any shape
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

// Weights kept exactly in fewer bytes (dflow_rt/models/exact_codes.py). Per block of 32 along a row of
// w, each weight is d * q + m (U4: q in 0..15, a nibble; scales d, m), d * q (I8: q in -128..127;
// scale d) or a bfloat16 (B16: the float32's high half, its low half being zero; no scale), rebuilt
// here as the very float32 it stands for (a multiply, then an add: the library is built with
// -ffp-contract=off) and then summed exactly as `product` sums it: results are bit-identical.
//
// Rows of w are stored in groups of kGroup, a group's blocks one after another, each block as a record:
// the kGroup rows' scales (float32), then their codes. A tile of kGroup rows of w reads one sequential
// stream (bench/exact_codes.py). The first tile over a group also prefetches the stream kAhead bytes
// ahead: on an AMX Xeon the hardware prefetcher alone left a step's products at a third of the read
// bandwidth, and 2 KB ahead made them 1.3-1.5x (1 row) and 1.6-1.85x (2-4 rows) faster (docs/experiments.md).
#ifndef DFLOW_RT_CODES_AHEAD  // other distances: docs/experiments.md, "codes ahead"
#define DFLOW_RT_CODES_AHEAD 2048
#endif
constexpr int64_t kBlock = 32, kGroup = 4, kAhead = DFLOW_RT_CODES_AHEAD, kLine = 64;

struct U4 {  // byte j of a row's codes: element j in its low nibble, element j + 16 in its high one
  static constexpr int64_t kScales = 2, kBytes = kBlock / 2, kRecord = kGroup * (kScales * 4 + kBytes);
#if defined(__AVX512F__)
  struct Block {  // the block's 16 values d * q + m, one per lane, and its codes widened to a byte a lane
    Vec table;
    __m512i q;
  };
  static Block load(const float* s, const uint8_t* codes) {
    const Vec levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return {vadd(vmul(vset(s[0]), levels), vset(s[1])), vbytes(codes)};
  }
  static Vec values(const Block& b, int64_t first) {  // elements [first, first + 16): a lookup by nibble
    return _mm512_permutexvar_ps(first ? _mm512_srli_epi32(b.q, 4) : b.q, b.table);
  }
#else
  struct Block {
    Vec d, m;
    const uint8_t* codes;
  };
  static Block load(const float* s, const uint8_t* codes) { return {vset(s[0]), vset(s[1]), codes}; }
  static Vec values(const Block& b, int64_t first) {
    return vadd(vmul(b.d, vfloat(vnibble(vbytes(b.codes + first % 16), first >= 16))), b.m);
  }
#endif
};

struct I8 {
  static constexpr int64_t kScales = 1, kBytes = kBlock, kRecord = kGroup * (kScales * 4 + kBytes);
  struct Block {
    Vec d;
    const int8_t* q;
  };
  static Block load(const float* s, const uint8_t* codes) { return {vset(s[0]), reinterpret_cast<const int8_t*>(codes)}; }
  static Vec values(const Block& b, int64_t first) { return vmul(b.d, vfloat(vbytes(b.q + first))); }
};

struct B16 {
  static constexpr int64_t kScales = 0, kBytes = 2 * kBlock, kRecord = kGroup * kBytes;
  using Block = const uint16_t*;
  static Block load(const float*, const uint8_t* codes) { return reinterpret_cast<const uint16_t*>(codes); }
  static Vec values(const Block& b, int64_t first) { return vbf16(b + first); }
};

// Row j of the group whose block record starts at `record`.
template <class C>
inline typename C::Block load(const uint8_t* record, int j) {
  return C::load(reinterpret_cast<const float*>(record) + j * C::kScales, record + kGroup * C::kScales * 4 + j * C::kBytes);
}

// `tile` over rows [j0, j0 + J) of a group of coded rows of w (rows [n0, n0 + kGroup)): each vector of w
// decoded once for the RX rows of x. Decoding is most of a coded product's work on AVX2, so a pass of
// 4+ rows takes them all in one tile over half a group (16 vector registers hold 4 x 2 accumulators,
// not 4 x 4) rather than two tiles over the whole group, which would decode every weight twice.
template <class C, int RX, int J>
inline void coded_tile(const float* x, const uint8_t* group, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
                       int j0) {
  Vec acc[RX][J];
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < J; ++j) acc[i][j] = vzero();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    if (kAhead > 0 && m0 == 0 && j0 == 0)  // the next tiles over this group read it from L1
      for (int64_t line = 0; line < C::kRecord; line += kLine)
        _mm_prefetch(reinterpret_cast<const char*>(group + b * C::kRecord + kAhead + line), _MM_HINT_T0);
    typename C::Block wb[J];
    for (int j = 0; j < J; ++j) wb[j] = load<C>(group + b * C::kRecord, j0 + j);
    for (int64_t first = 0; first < kBlock; first += kLanes) {
      Vec wv[J];
      for (int j = 0; j < J; ++j) wv[j] = C::values(wb[j], first);
      for (int i = 0; i < RX; ++i) {
        const Vec xv = vload(x + (m0 + i) * K + b * kBlock + first, kLanes);
        for (int j = 0; j < J; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < J; ++j) y[(m0 + i) * N + n0 + j0 + j] = vsum(acc[i][j]);
}

template <class C, int RX, int J>
void coded_product(const float* x, const uint8_t* codes, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t group_bytes = K / kBlock * C::kRecord;
  at::parallel_for(0, N / kGroup, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = codes + g * group_bytes;
      int64_t m = 0;
      for (; m + RX <= M; m += RX)
        for (int j0 = 0; j0 < kGroup; j0 += J) coded_tile<C, RX, J>(x, group, y, K, N, m, g * kGroup, j0);
      for (; m < M; ++m) coded_tile<C, 1, kGroup>(x, group, y, K, N, m, g * kGroup, 0);
    }
  });
}

template <class C>
int64_t check_codes(const at::Tensor& codes) {  // K, from the codes' shape
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes: uint8 [rows / ", kGroup, ", blocks * ", C::kRecord, "]");
  TORCH_CHECK(codes.size(1) % C::kRecord == 0, "codes: whole blocks per group of rows");
  return codes.size(1) / C::kRecord * kBlock;
}

// y = x @ w.T with w given by its codes.
template <class C>
at::Tensor coded_gemv(const at::Tensor& x, const at::Tensor& codes) {
  const int64_t K = check_codes<C>(codes);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: float32 [M, K]");
  const int64_t M = x.size(0), N = codes.size(0) * kGroup;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // rows of w per 4-row tile: AVX-512's 32 vector registers hold 4 x 4 accumulators, AVX2's 16 hold 4 x 2
  constexpr int span = kLanes == 16 ? kGroup : kGroup / 2;
  if (M == 1) coded_product<C, 1, kGroup>(xp, cp, yp, M, K, N);
  else if (M < 4) coded_product<C, 2, kGroup>(xp, cp, yp, M, K, N);
  else coded_product<C, 4, span>(xp, cp, yp, M, K, N);
  return y;
}

// w itself, as float32 [N, K]: what the codes stand for, rebuilt exactly as the products rebuild it.
template <class C>
at::Tensor decode(const at::Tensor& codes) {
  const int64_t K = check_codes<C>(codes), blocks = K / kBlock;
  at::Tensor w = at::empty({codes.size(0) * kGroup, K}, codes.options().dtype(at::kFloat));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, codes.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < blocks; ++b)
        for (int j = 0; j < kGroup; ++j) {
          const typename C::Block block = load<C>(cp + (g * blocks + b) * C::kRecord, j);
          for (int64_t first = 0; first < kBlock; first += kLanes) {
            const Vec v = C::values(block, first);
            std::memcpy(wp + (g * kGroup + j) * K + b * kBlock + first, &v, sizeof(v));
          }
        }
  });
  return w;
}

}  // namespace

// The schema is defined on the Python side (dflow_rt/kernels/cpu/ops.py), with its shape function.
TORCH_LIBRARY_IMPL(dflow_rt, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("gemv_u4", &coded_gemv<U4>);
  m.impl("gemv_i8", &coded_gemv<I8>);
  m.impl("gemv_b16", &coded_gemv<B16>);
  m.impl("decode_u4", &decode<U4>);
  m.impl("decode_i8", &decode<I8>);
  m.impl("decode_b16", &decode<B16>);
}
