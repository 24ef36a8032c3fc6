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
#if defined(TOKENMILL_SIMD)
  const vfloat m = vset1(max);
  vfloat acc = vzero();
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const vfloat e = vexp(vsub(vload(s + t), m));
    vstore(s + t, e);
    acc = vadd(acc, e);
  }
  if (t < n) {
    const vmask valid = vrange(0, n - t);
    const vfloat e = vkeep(valid, vexp(vsub(vload_masked(s + t, valid), m)));
    vstore_masked(s + t, valid, e);
    acc = vadd(acc, e);
  }
  return vsum(acc);
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
#if defined(TOKENMILL_SIMD)
  vfloat vmx = vset1(mx);
  for (; t + kLanes <= n; t += kLanes) vmx = vmax(vmx, vload(s + t));
  if (t < n) {
    const vmask tail = vrange(0, n - t);
    vmx = vmax_masked(vmx, tail, vload_masked(s + t, tail));
  }
  mx = vmax_of(vmx);
#else
  for (; t < n; ++t) mx = std::max(mx, s[t]);
#endif
  return 1.f / exp_shifted(s, n, mx);
}

// Whether the caches hold bf16 under float32 queries (cache.kv_cache_dtype); checks that
// otherwise the caches share the query's dtype, and out always does.
inline bool bf16_cache_under_fp32(const char* kernel, const at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache) {
  const bool mixed = query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK((key_cache.scalar_type() == query.scalar_type() || mixed) && out.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              kernel, ": out and query of one dtype, the caches of the same or (under float32) bfloat16");
  return mixed;
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

#if defined(TOKENMILL_SIMD)
// Keys per tile of the attention kernels: one vector of scores (one cache block at the usual
// block size with AVX-512).
constexpr int64_t kTile = kLanes;
#endif

}  // namespace tokenmill
