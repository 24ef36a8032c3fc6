// Softmax and tile reductions shared by the decode and prefill attention kernels.
#pragma once

#include <algorithm>
#include <limits>
#include <type_traits>

#include "vec.h"

namespace tokenmill {

// s[t] = exp(s[t] - max); returns the sum. The last partial vector is masked, not scalar:
// a prompt row's length is anything, and std::exp on its tail was ~5% of prefill attention.
inline float exp_shifted(float* s, int64_t n, float max) {
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(max);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 valid = n - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, s + t), m));
    _mm512_mask_storeu_ps(s + t, valid, e);
    acc = _mm512_mask_add_ps(acc, valid, acc, e);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - max);
    sum += s[t];
  }
  return sum;
#endif
}

// softmax numerator of one head's scores in place (after the optional tanh soft cap);
// returns 1 / the denominator
inline float softmax_unnormalized(float* s, int64_t n, double soft_cap) {
  if (soft_cap > 0) {
    const float cap = static_cast<float>(soft_cap);
    for (int64_t t = 0; t < n; ++t) s[t] = std::tanh(s[t] / cap) * cap;
  }
  float mx = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(mx);
  for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
  if (t < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1);
    vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, s + t));
  }
  mx = _mm512_reduce_max_ps(vmax);
#else
  for (; t < n; ++t) mx = std::max(mx, s[t]);
#endif
  return 1.f / exp_shifted(s, n, mx);
}

// f(std::integral_constant<int64_t, value>{}) for value in 1..8: kernels specialised per
// head_dim / 32 (or rows per block) keep their accumulators in registers
template <typename F>
void with_constant_1_to_8(int64_t value, F&& f) {
  switch (value) {
    case 1: f(std::integral_constant<int64_t, 1>{}); break;
    case 2: f(std::integral_constant<int64_t, 2>{}); break;
    case 3: f(std::integral_constant<int64_t, 3>{}); break;
    case 4: f(std::integral_constant<int64_t, 4>{}); break;
    case 5: f(std::integral_constant<int64_t, 5>{}); break;
    case 6: f(std::integral_constant<int64_t, 6>{}); break;
    case 7: f(std::integral_constant<int64_t, 7>{}); break;
    case 8: f(std::integral_constant<int64_t, 8>{}); break;
    default: TORCH_CHECK(false, "expected 1 to 8, got ", value);
  }
}

#if defined(__AVX512F__)
// Keys per tile of the bf16 kernels (one cache block at the usual block size).
constexpr int64_t kTile = 16;

// lane i of the result = the sum of v[i]'s lanes
inline __m512 reduce16_transposed(__m512 v[16]) {
  __m512 pair[8];
  for (int i = 0; i < 8; ++i)  // 128-bit lane j: [a0+a2, b0+b2, a1+a3, b1+b3]
    pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 quad[4];
  for (int i = 0; i < 4; ++i)  // 128-bit lane j: the four vectors' sums over lane j
    quad[i] = _mm512_add_ps(_mm512_shuffle_ps(pair[2 * i], pair[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_ps(pair[2 * i], pair[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 half[2];
  for (int i = 0; i < 2; ++i)  // lanes 0+2 and 1+3 of two quads
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], 0x44),
                            _mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(half[0], half[1], 0x88), _mm512_shuffle_f32x4(half[0], half[1], 0xDD));
}

#endif

#if defined(__AVX512F__)
// 32 consecutive values of a row as two fp32 vectors (bf16: its even and odd elements, the
// layout that widening bf16 pairs by a shift and a mask gives), and back.
struct Pair {
  __m512 a, b;
};
inline Pair load32(const float* x) { return {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)}; }
inline void store32(float* out, Pair v) {
  _mm512_storeu_ps(out, v.a);
  _mm512_storeu_ps(out + 16, v.b);
}
#if defined(__AVX512BF16__)
inline Pair load32(const c10::BFloat16* x) {
  const __m512i bits = _mm512_loadu_si512(x);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
}
// rounds like static_cast<c10::BFloat16>
inline void store32(c10::BFloat16* out, Pair v) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v.a));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v.b));
  _mm512_storeu_si512(out, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
}
#endif
#endif

}  // namespace tokenmill
