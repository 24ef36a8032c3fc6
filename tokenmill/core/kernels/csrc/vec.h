// Small AVX-512 helpers shared by the CPU kernels; every caller has a scalar fallback.
#pragma once

#include <torch/extension.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstring>
#include <type_traits>

namespace tokenmill {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }
// bf16 -> fp32 is a 16-bit shift; spelled out so the compiler can vectorize it
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// Round to T and back (the eager code's casts), and stores, 16 lanes at a time.
inline __m512 round16(__m512 v, const float*) { return v; }
inline void store16(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
#if defined(__AVX512BF16__)
inline __m512 round16(__m512 v, const c10::BFloat16*) {
  const __m256i bits = (__m256i)_mm512_cvtneps_pbh(v);  // round to nearest even, like c10::BFloat16
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store16(c10::BFloat16* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// exp(x): Cephes' expf polynomial with range reduction, ~1 ulp; inputs below -87 give ~0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// q . k in fp32 (k widened from T): one accumulator, 16 lanes, then a tree reduction
template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), sum);
    return _mm512_reduce_add_ps(sum);
  }
#endif
  float sum = 0.f;
  for (int64_t d = 0; d < n; ++d) sum += q[d] * to_float(k[d]);
  return sum;
}

//: whether T has the 16-lane load/round/store above on this build
template <typename T>
constexpr bool kVectorized =
#if defined(__AVX512F__)
    std::is_same_v<T, float>
#if defined(__AVX512BF16__)
    || std::is_same_v<T, c10::BFloat16>
#endif
#else
    false
#endif
    ;

}  // namespace tokenmill
