// Greedy tokens of an fp32 output projection from bf16 screening logits.
//
// tokens[m] = argmax_j x[m] . w[j], the logits computed in fp32, given screen[m][j]:
// the same products from bf16-rounded x and w (fp32 accumulation, bf16 output), which
// oneDNN computes twice as fast as the fp32 GEMM. Each screened logit is within a
// proven bound of the exact one, so only tokens whose upper bound reaches the best
// lower bound can be the argmax; those few get their logits recomputed in fp32.
//
// Bound (u = 2^-8, bf16's unit roundoff; g = K 2^-24 / (1 - K 2^-24), fp32 summation
// of K terms in any order):
//   |x.w - screen| <= (2u + u^2 + g (1 + u)^2) sum|x||w| + u / (1 - u) |screen|
// and sum|x||w| <= |x| |w| (Cauchy-Schwarz, |w| precomputed per row). The first term
// takes 3g instead of g, so a token whose fp32 logit (not only its exact one) could
// beat a candidate's is a candidate too, and everything gets a 1% margin for the
// norms' own rounding. Ties go to the lowest index, as torch.argmax.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "kernels.h"
#include "vec.h"

namespace tokenmill {
namespace {

struct Bound {
  float per_norm, per_value;
  static constexpr float kTiny = 1e-30f;  // bf16 arithmetic flushes subnormals to zero
  Bound(int64_t K) {
    const double u = std::ldexp(1.0, -8), g = K * std::ldexp(1.0, -24) / (1.0 - K * std::ldexp(1.0, -24));
    per_norm = static_cast<float>(1.01 * (2 * u + u * u + 3 * g * (1 + u) * (1 + u)));
    per_value = static_cast<float>(1.01 * u / (1 - u));
  }
  float operator()(float screened, float scaled_norm) const {
    return scaled_norm + per_value * std::fabs(screened) + kTiny;
  }
};

// one row: returns (token, candidates)
std::pair<int64_t, int64_t> screen_row(const float* x, const float* w, const c10::BFloat16* screen,
                                       const float* norms, int64_t N, int64_t K, const Bound& bound) {
  const float x_norm = std::sqrt(dot(x, x, K));
  const float scale = bound.per_norm * x_norm;
  float best_lower = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 lower16 = _mm512_set1_ps(best_lower);
  const __m512 scale16 = _mm512_set1_ps(scale), value16 = _mm512_set1_ps(bound.per_value);
  const __m512 tiny16 = _mm512_set1_ps(Bound::kTiny);
  auto bound16 = [&](__m512 s, int64_t at) {
    return _mm512_add_ps(_mm512_fmadd_ps(value16, _mm512_abs_ps(s), tiny16),
                         _mm512_mul_ps(scale16, _mm512_loadu_ps(norms + at)));
  };
  for (; j + 16 <= N; j += 16) {
    const __m512 s = load16(screen + j);
    lower16 = _mm512_max_ps(lower16, _mm512_sub_ps(s, bound16(s, j)));
  }
  best_lower = _mm512_reduce_max_ps(lower16);
#endif
  for (; j < N; ++j) {
    const float s = to_float(screen[j]);
    best_lower = std::max(best_lower, s - bound(s, scale * norms[j]));
  }
  int64_t token = -1, candidates = 0;
  float best = -std::numeric_limits<float>::infinity();
  auto check = [&](int64_t at) {
    ++candidates;
    const float logit = dot(x, w + at * K, K);
    if (token < 0 || logit > best) {
      best = logit;
      token = at;
    }
  };
  j = 0;
#if defined(__AVX512F__)
  const __m512 threshold16 = _mm512_set1_ps(best_lower);
  for (; j + 16 <= N; j += 16) {
    const __m512 s = load16(screen + j);
    __mmask16 hits = _mm512_cmp_ps_mask(_mm512_add_ps(s, bound16(s, j)), threshold16, _CMP_GE_OQ);
    for (; hits; hits &= hits - 1) check(j + __builtin_ctz(hits));
  }
#endif
  for (; j < N; ++j) {
    const float s = to_float(screen[j]);
    if (s + bound(s, scale * norms[j]) >= best_lower) check(j);
  }
  return {token, candidates};
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> screened_argmax(torch::Tensor x, torch::Tensor weight,
                                                         torch::Tensor screen, torch::Tensor norms) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "screened_argmax: x [M, K] fp32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat && weight.is_contiguous() &&
                  weight.size(1) == x.size(1), "screened_argmax: weight [N, K] fp32");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  TORCH_CHECK(screen.scalar_type() == torch::kBFloat16 && screen.is_contiguous() && screen.numel() == M * N,
              "screened_argmax: screen [M, N] bf16");
  TORCH_CHECK(norms.scalar_type() == torch::kFloat && norms.is_contiguous() && norms.numel() == N,
              "screened_argmax: norms [N] fp32");
  torch::Tensor tokens = torch::empty({M}, x.options().dtype(torch::kLong));
  torch::Tensor candidates = torch::empty({M}, x.options().dtype(torch::kLong));
  const Bound bound(K);
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const auto* s = screen.data_ptr<c10::BFloat16>();
  const float* n = norms.data_ptr<float>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  int64_t* cand = candidates.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) std::tie(tok[m], cand[m]) = screen_row(xs + m * K, w, s + m * N, n, N, K, bound);
  });
  return {tokens, candidates};
}

}  // namespace tokenmill
