// The vector type and the few operations the CPU kernels (gemv.cpp, attention.cpp) are
// written in, per instruction set: AVX-512, or AVX2 with FMA.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace dflow_rt_cpu {

// AVX2 has 16 vector registers against AVX-512's 32, so its tiles are smaller (`gemv` picks them).
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p, int64_t n) {  // the first n (<= kLanes) floats at p, zeros after
  return n == kLanes ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
inline Vec vload_or(const float* p, int64_t n, float fill) {  // the first n floats at p, `fill` after
  return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), static_cast<__mmask16>((1u << n) - 1u), p);
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vset(float a) { return _mm512_set1_ps(a); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vround(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vscale2(Vec a, Vec n) { return _mm512_scalef_ps(a, n); }  // a * 2^n, n integral
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void vstore(float* p, Vec v, int64_t n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v); }
inline float vmaxall(Vec v) { return _mm512_reduce_max_ps(v); }
// Lane i of the result is the sum of a[i]'s lanes, by a fixed tree: pairs of vectors interleaved and
// added, then pairs of those, then 128-bit quarters (16 sums in 30 shuffles rather than 64).
inline Vec vsums(const Vec (&a)[kLanes]) {
  auto pairs = [](Vec x, Vec y) { return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y)); };
  auto halves = [](Vec x, Vec y) { return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE)); };
  auto quarters = [](Vec x, Vec y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  };
  Vec b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) b[i] = pairs(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 4; ++i) c[i] = halves(b[2 * i], b[2 * i + 1]);
  for (int i = 0; i < 2; ++i) d[i] = quarters(c[2 * i], c[2 * i + 1]);
  return quarters(d[0], d[1]);
}
// kLanes bytes at p, widened to one int32 lane each (unsigned or signed)
inline __m512i vbytes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512i vbytes(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vec vfloat(__m512i v) { return _mm512_cvtepi32_ps(v); }
// kLanes bfloat16 bit patterns at p as the float32 values they are (the high half of each lane)
inline Vec vbf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p, int64_t n) {
  if (n == kLanes) return _mm256_loadu_ps(p);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
}
inline Vec vload_or(const float* p, int64_t n, float fill) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, in), _mm256_castsi256_ps(in));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {  // halves, then pairs, then the last two: one fixed tree
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vset(float a) { return _mm256_set1_ps(a); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vround(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vscale2(Vec a, Vec n) {  // a * 2^n, n integral in -126..127: n built as a float's exponent
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(a, _mm256_castsi256_ps(e));
}
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void vstore(float* p, Vec v, int64_t n) {  // the first n lanes
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane), v);
}
inline float vmaxall(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline Vec vsums(const Vec (&a)[kLanes]) {  // see the AVX-512 one: 8 sums, 128-bit halves last
  auto pairs = [](Vec x, Vec y) { return _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y)); };
  auto halves = [](Vec x, Vec y) { return _mm256_add_ps(_mm256_shuffle_ps(x, y, 0x44), _mm256_shuffle_ps(x, y, 0xEE)); };
  Vec b[4], c[2];
  for (int i = 0; i < 4; ++i) b[i] = pairs(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) c[i] = halves(b[2 * i], b[2 * i + 1]);
  return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}
inline __m256i vbytes(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i vbytes(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline Vec vfloat(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline Vec vbf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256i vnibble(__m256i v, bool high)  // a byte's low or high 4 bits (AVX-512 looks nibbles up instead)
   { return high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15)); }
#else
#error "the CPU kernels need AVX-512 or AVX2 with FMA (cpu_gemv.py builds it only there)"
#endif

// 2^x lane by lane for the softmax's weights (x <= 0): 2^round(x) times a degree-7 polynomial on the
// rest, within 2 ulp; below -126 it gives 2^-126, far under any sum of weights that holds a 1; a NaN
// stays NaN, so a NaN in a visible key reaches the output as it does through SDPA.
inline Vec vexp2(Vec x) {
  x = vmax(vset(-126.0f), x);  // this order keeps a NaN (max returns its second operand then)
  const Vec n = vround(x), f = vsub(x, n);
  Vec p = vset(1.5252734e-05f);
  for (float c : {1.5403530e-04f, 1.3333558e-03f, 9.6181291e-03f, 5.5504109e-02f, 2.4022651e-01f, 6.9314718e-01f, 1.0f})
    p = vfma(p, f, vset(c));
  return vscale2(p, n);
}

}  // namespace dflow_rt_cpu
