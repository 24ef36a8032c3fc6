// One vector of fp32 lanes for the CPU kernels: AVX-512 (16 lanes) or AVX2 with FMA (8 lanes),
// whichever the compiler flags (-march=native) allow. Kernels are written once against these
// helpers, so the same loops run on Intel's AVX-512 parts and on AMD Zen 2/3 or older Intel
// (AVX2 only), where the scalar fallbacks ran at a fraction of the speed; every caller keeps
// a scalar path for CPUs with neither (TOKENMILL_SIMD undefined).
#pragma once

#include "aten.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TOKENMILL_SIMD 1
#include <immintrin.h>
#endif

#include <cmath>
#include <cstring>
#include <limits>
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
using vfloat = __m512;
using vint = __m512i;
using vmask = __mmask16;
constexpr int64_t kLanes = 16;

inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vload(const float* x) { return _mm512_loadu_ps(x); }
inline void vstore(float* x, vfloat v) { _mm512_storeu_ps(x, v); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat vmin(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
inline float vmax_of(vfloat v) { return _mm512_reduce_max_ps(v); }

// lanes [from, to)
inline vmask vrange(int64_t from, int64_t to) {
  return static_cast<vmask>(((1u << to) - 1) & ~((1u << from) - 1));
}
inline vfloat vload_masked(const float* x, vmask m) { return _mm512_maskz_loadu_ps(m, x); }
inline void vstore_masked(float* x, vmask m, vfloat v) { _mm512_mask_storeu_ps(x, m, v); }
inline vfloat vkeep(vmask m, vfloat v) { return _mm512_maskz_mov_ps(m, v); }  // v where m, else 0
inline vfloat vmax_masked(vfloat acc, vmask m, vfloat x) { return _mm512_mask_max_ps(acc, m, acc, x); }

inline vfloat vfrom_bits(vint bits) { return _mm512_castsi512_ps(bits); }
inline vint vbits(vfloat v) { return _mm512_castps_si512(v); }
inline vint vbroadcast_i32(int32_t x) { return _mm512_set1_epi32(x); }
inline vint vadd_i32(vint a, vint b) { return _mm512_add_epi32(a, b); }
inline vint vsub_i32(vint a, vint b) { return _mm512_sub_epi32(a, b); }
inline vfloat vcvt_i32(vint a) { return _mm512_cvtepi32_ps(a); }
inline vfloat vabs(vfloat v) { return _mm512_abs_ps(v); }
inline uint32_t vge_bits(vfloat a, vfloat b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }  // lane i: a >= b
inline vint vand_i(vint a, vint b) { return _mm512_and_si512(a, b); }
inline vint vor_i(vint a, vint b) { return _mm512_or_si512(a, b); }
inline vint vshl16(vint a) { return _mm512_slli_epi32(a, 16); }
inline vint vshr16(vint a) { return _mm512_srli_epi32(a, 16); }
inline vint vnan_to(vfloat v, vint bits, vint nan_bits) {
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), bits, nan_bits);
}
inline vint vload_bits(const void* x) { return _mm512_loadu_si512(x); }
inline void vstore_bits(void* x, vint v) { _mm512_storeu_si512(x, v); }
// kLanes 16-bit values widened to the high (bf16) or low halves of 32-bit lanes, and back
inline vint vload_u16(const void* x) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(x))); }
inline void vstore_u16(void* x, vint low_halves) {
  _mm256_storeu_si256(static_cast<__m256i*>(x), _mm512_cvtepi32_epi16(low_halves));
}
inline vfloat vload(const c10::Half* x) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); }
inline vfloat vround_to_integer(vfloat x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vfloat vscale_pow2(vfloat p, vfloat n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral

// lane i of the result = the sum of v[i]'s lanes. Always inlined: called out of line (as GCC chose
// once all the kernels shared one unit) its argument's kLanes vectors go through memory, and the
// 5-row GEMV of a verify step took ~1.6x as long.
__attribute__((always_inline)) inline vfloat vsum_transposed(const vfloat v[kLanes]) {
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

#elif defined(TOKENMILL_SIMD)
using vfloat = __m256;
using vint = __m256i;
using vmask = __m256;  // all-ones lanes where set
constexpr int64_t kLanes = 8;

inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* x) { return _mm256_loadu_ps(x); }
inline void vstore(float* x, vfloat v) { _mm256_storeu_ps(x, v); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat vmin(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c
inline float vsum(vfloat v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vmax_of(vfloat v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline vmask vrange(int64_t from, int64_t to) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i below_to = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(to)), lane);
  const __m256i from_on = _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(from - 1)));
  return _mm256_castsi256_ps(_mm256_and_si256(below_to, from_on));
}
inline vfloat vload_masked(const float* x, vmask m) { return _mm256_maskload_ps(x, _mm256_castps_si256(m)); }
inline void vstore_masked(float* x, vmask m, vfloat v) { _mm256_maskstore_ps(x, _mm256_castps_si256(m), v); }
inline vfloat vkeep(vmask m, vfloat v) { return _mm256_and_ps(m, v); }
inline vfloat vmax_masked(vfloat acc, vmask m, vfloat x) { return _mm256_blendv_ps(acc, _mm256_max_ps(acc, x), m); }

inline vfloat vfrom_bits(vint bits) { return _mm256_castsi256_ps(bits); }
inline vint vbits(vfloat v) { return _mm256_castps_si256(v); }
inline vint vbroadcast_i32(int32_t x) { return _mm256_set1_epi32(x); }
inline vint vadd_i32(vint a, vint b) { return _mm256_add_epi32(a, b); }
inline vint vsub_i32(vint a, vint b) { return _mm256_sub_epi32(a, b); }
inline vfloat vcvt_i32(vint a) { return _mm256_cvtepi32_ps(a); }
inline vfloat vabs(vfloat v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
inline uint32_t vge_bits(vfloat a, vfloat b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
inline vint vand_i(vint a, vint b) { return _mm256_and_si256(a, b); }
inline vint vor_i(vint a, vint b) { return _mm256_or_si256(a, b); }
inline vint vshl16(vint a) { return _mm256_slli_epi32(a, 16); }
inline vint vshr16(vint a) { return _mm256_srli_epi32(a, 16); }
inline vint vnan_to(vfloat v, vint bits, vint nan_bits) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bits), _mm256_castsi256_ps(nan_bits),
                                               _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline vint vload_bits(const void* x) { return _mm256_loadu_si256(static_cast<const __m256i*>(x)); }
inline void vstore_bits(void* x, vint v) { _mm256_storeu_si256(static_cast<__m256i*>(x), v); }
inline vint vload_u16(const void* x) { return _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(x))); }
inline void vstore_u16(void* x, vint low_halves) {  // every lane < 2^16, so the saturating pack is exact
  _mm_storeu_si128(static_cast<__m128i*>(x), _mm_packus_epi32(_mm256_castsi256_si128(low_halves),
                                                               _mm256_extracti128_si256(low_halves, 1)));
}
#if defined(__F16C__)
inline vfloat vload(const c10::Half* x) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))); }
#endif
inline vfloat vround_to_integer(vfloat x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vfloat vscale_pow2(vfloat p, vfloat n) {  // p * 2^n for integral n in [-126, 127]
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(
                              _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)));
}

__attribute__((always_inline)) inline vfloat vsum_transposed(const vfloat v[kLanes]) {  // see above
  // hadd pairs lanes within 128-bit halves: after two rounds, half h of u[i] holds v[4i..4i+3]'s
  // sums over their lanes of half h
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#if defined(TOKENMILL_SIMD)
inline vfloat vload(const c10::BFloat16* x) { return vfrom_bits(vshl16(vload_u16(x))); }

// bf16 bits of each lane, in the lane's high half (low half zero), rounded as
// static_cast<c10::BFloat16> rounds: to nearest even, NaN to 0x7FC0
inline vint vbf16_bits(vfloat v) {
#if defined(__AVX512BF16__)
  return vshl16(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)));
#else
  const vint bits = vbits(v);
  const vint bias = vadd_i32(vand_i(vshr16(bits), vbroadcast_i32(1)), vbroadcast_i32(0x7FFF));
  const vint rounded = vand_i(vadd_i32(bits, bias), vbroadcast_i32(static_cast<int32_t>(0xFFFF0000u)));
  return vnan_to(v, rounded, vbroadcast_i32(0x7FC00000));
#endif
}

// Round to T and back (the eager code's casts), and stores, kLanes values at a time.
inline vfloat vround(vfloat v, const float*) { return v; }
inline vfloat vround(vfloat v, const c10::BFloat16*) { return vfrom_bits(vbf16_bits(v)); }
inline void vstore(c10::BFloat16* dst, vfloat v) { vstore_u16(dst, vshr16(vbf16_bits(v))); }

// exp(x): Cephes' expf polynomial with range reduction, ~1 ulp; inputs below -87 give ~0.
inline vfloat vexp(vfloat x) {
  x = vmax(x, vset1(-87.0f));
  x = vmin(x, vset1(88.0f));
  const vfloat n = vround_to_integer(vmul(x, vset1(1.44269504088896341f)));
  vfloat r = vfmadd(n, vset1(-0.693359375f), x);
  r = vfmadd(n, vset1(2.12194440e-4f), r);
  vfloat p = vset1(1.9875691500e-4f);
  p = vfmadd(p, r, vset1(1.3981999507e-3f));
  p = vfmadd(p, r, vset1(8.3334519073e-3f));
  p = vfmadd(p, r, vset1(4.1665795894e-2f));
  p = vfmadd(p, r, vset1(1.6666665459e-1f));
  p = vfmadd(p, r, vset1(5.0000001201e-1f));
  p = vfmadd(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vscale_pow2(p, n);
}

// 2 * kLanes consecutive values of a row as two fp32 vectors (bf16: its even and odd elements,
// the layout that widening bf16 pairs by a shift and a mask gives), and back.
constexpr int64_t kPair = 2 * kLanes;
struct Pair {
  vfloat a, b;
};
inline Pair load_pair(const float* x) { return {vload(x), vload(x + kLanes)}; }
inline void store_pair(float* out, Pair v) {
  vstore(out, v.a);
  vstore(out + kLanes, v.b);
}
inline Pair load_pair(const c10::BFloat16* x) {
  const vint bits = vload_bits(x);
  return {vfrom_bits(vshl16(bits)), vfrom_bits(vand_i(bits, vbroadcast_i32(static_cast<int32_t>(0xFFFF0000u))))};
}
inline void store_pair(c10::BFloat16* out, Pair v) { vstore_bits(out, vor_i(vshr16(vbf16_bits(v.a)), vbf16_bits(v.b))); }
// 2 * kLanes values of a T row in the layout store_pair(Out*) expects: load_pair's own where
// Out is T (bf16: even/odd), else both halves widened in order (a bf16 cache under fp32 queries)
template <typename Out, typename T>
inline Pair load_pair_for(const T* x) {
  if constexpr (std::is_same_v<Out, T>) return load_pair(x);
  else return {vload(x), vload(x + kLanes)};
}

// acc + lane-wise products of a and b over kDotStep<A, B> values (reduce acc's lanes for the dot)
template <typename A, typename B>
constexpr int64_t kDotStep = kLanes;
template <typename A, typename B>
inline vfloat dot_step(vfloat acc, const A* a, const B* b) { return vfmadd(vload(a), vload(b), acc); }
#if defined(__AVX512BF16__)
// bf16 x bf16: the pair dot product on raw bf16, 32 values per instruction (each product exact in fp32)
template <>
constexpr int64_t kDotStep<c10::BFloat16, c10::BFloat16> = 32;
inline vfloat dot_step(vfloat acc, const c10::BFloat16* a, const c10::BFloat16* b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
}
#endif
#endif

// q . k in fp32 (k widened from T): one accumulator, then a tree reduction
template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
#if defined(TOKENMILL_SIMD)
  if (n % kLanes == 0) {
    vfloat sum = vzero();
    for (int64_t d = 0; d < n; d += kLanes) sum = vfmadd(vload(q + d), vload(k + d), sum);
    return vsum(sum);
  }
#endif
  float sum = 0.f;
  for (int64_t d = 0; d < n; ++d) sum += q[d] * to_float(k[d]);
  return sum;
}

//: whether T has the vector load/round/store above on this build
template <typename T>
constexpr bool kVectorized =
#if defined(TOKENMILL_SIMD)
    std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

}  // namespace tokenmill
