// Greedy tokens of an fp32 output projection from int8 screening logits.
//
// tokens[m] = argmax_j x[m] . w[j], the logits computed in fp32. The screen is the same
// products from int8 x (per-row scale) and int8 w (per-output-row scale) with exact int32
// sums: AVX512-VNNI multiplies 64 byte pairs per instruction, so the screen takes ~11 ms
// per 128 rows at the benchmark head (32000 x 512) where oneDNN's bf16 GEMM took ~21.
// AVX2 has no such instruction: unsigned x bytes times signed w bytes summed in pairs to
// 16 bits (vpmaddubsw), then in pairs to 32 (vpmaddwd), the same 4-product sums as one VNNI
// step. Its 16-bit pair sums saturate past 32767, so there x is quantized to 63 levels
// (u = q + 64 <= 127, |u w0 + u w1| <= 2 * 127 * 127): a coarser screen, the same bound.
// Each screened logit is within a proven bound of the exact one, so only tokens whose
// upper bound reaches the best lower bound can be the argmax; those few (about 15 per row
// at the benchmark shapes) get their logits recomputed in fp32.
//
// Bound. With x = s_x q + e and w_j = s_j p_j + f_j (q, p the rounded int8 values, e, f
// the residuals, known when quantizing):
//   x.w_j - s_x s_j q.p_j = e.w_j + s_x q.f_j,   so by Cauchy-Schwarz
//   |x.w_j - screen_j| <= |e| |w_j| + s_x |q| |f_j|
// (|w_j| and |f_j| precomputed per row, |e| and |q| per x row), plus the fp32 rounding of
// screen_j = s_x (s_j float(q.p_j)) (3 roundings, u32 = 2^-24 each; 6 u32 |screen_j| also
// covers adding the bound to it) and, so that a token
// whose fp32 logit (not only its exact one) could beat a candidate's is a candidate too,
// 3g |x| |w_j| (g = K u32 / (1 - K u32): fp32 summation of K terms in any order); with a
// 1% margin for the norms' own rounding. Ties go to the lowest index, as torch.argmax.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "attention_math.h"
#include "kernels.h"
#include "vec.h"

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(TOKENMILL_SIMD))
namespace tokenmill {
namespace {

constexpr float kTiny = 1e-30f;  // keeps the bound positive when every norm is zero

// acc[m][j] = sum_k u[m][k] p[j][k] for u = q + kXOffset (the byte products are unsigned x
// signed); the caller subtracts kXOffset sum_k p[j][k]. Rows x NB column groups of 16 per
// call, all accumulators in registers (rows and NB compile-time: a runtime row count made
// the compiler shuttle accumulators through one register, 3x slower).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kRows = 8;       // x rows per register tile
constexpr int64_t kGroups = 3;     // 48 columns per tile: 24 accumulators + 3 weight registers
constexpr float kXLevels = 127.f;  // |q| <= kXLevels
constexpr int32_t kXOffset = 128;

template <int64_t Rows, int NB>
inline void int8_block(const uint8_t* x0, const int8_t* const* w, int32_t* out, int64_t Np, int64_t Kp) {
  __m512i sum[Rows][NB];
  for (int64_t r = 0; r < Rows; ++r)
    for (int i = 0; i < NB; ++i) sum[r][i] = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp / 4; ++k) {
    __m512i b[NB];
    for (int i = 0; i < NB; ++i) b[i] = _mm512_loadu_si512(w[i] + k * 64);
    for (int64_t r = 0; r < Rows; ++r) {
      const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x0 + r * Kp + k * 4));
      for (int i = 0; i < NB; ++i) sum[r][i] = _mm512_dpbusd_epi32(sum[r][i], a, b[i]);
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int i = 0; i < NB; ++i) _mm512_storeu_si512(out + r * Np + i * 16, sum[r][i]);
}
#else
constexpr int64_t kRows = 4;       // 8 accumulators, 2 weight registers, x, ones: 12 of 16
constexpr int64_t kGroups = 1;
constexpr float kXLevels = 63.f;
constexpr int32_t kXOffset = 64;

template <int64_t Rows, int NB>
inline void int8_block(const uint8_t* x0, const int8_t* const* w, int32_t* out, int64_t Np, int64_t Kp) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum[Rows][2 * NB];
#pragma GCC unroll 16
  for (int64_t r = 0; r < Rows; ++r)
#pragma GCC unroll 16
    for (int i = 0; i < 2 * NB; ++i) sum[r][i] = _mm256_setzero_si256();
  for (int64_t k = 0; k < Kp / 4; ++k) {
    __m256i b[2 * NB];  // each 64-byte group: columns 0-7, then 8-15, 4 bytes each
#pragma GCC unroll 16
    for (int i = 0; i < 2 * NB; ++i) b[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i / 2] + k * 64 + (i % 2) * 32));
#pragma GCC unroll 16
    for (int64_t r = 0; r < Rows; ++r) {
      const __m256i a = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x0 + r * Kp + k * 4));
#pragma GCC unroll 16
      for (int i = 0; i < 2 * NB; ++i)
        sum[r][i] = _mm256_add_epi32(sum[r][i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b[i]), ones));
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < Rows; ++r)
#pragma GCC unroll 16
    for (int i = 0; i < 2 * NB; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * Np + i * 8), sum[r][i]);
}
#endif

// NB column groups from `group`, for all M rows: the groups' packed weights (NB x Kp bytes
// per 16 columns) stay in L1 while every row block uses them.
template <int NB>
void int8_tile(const uint8_t* u, const int8_t* packed, int32_t* acc, int64_t M, int64_t Np, int64_t Kp,
               int64_t group) {
  const int8_t* w[NB];
  for (int i = 0; i < NB; ++i) w[i] = packed + (group + i) * (Kp / 4) * 64;
  int32_t* out = acc + group * 16;
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) int8_block<kRows, NB>(u + m * Kp, w, out + m * Np, Np, Kp);
  // the rest in one block too (a verify step's 5 rows): one row at a time, each k step waits on
  // the last one's sums (the whole kernel at a 4096 x 256 head: 69 us for 5 rows so, 41 us as
  // one block, 20 us for one row)
  if (m < M)
    with_constant_1_to_8(M - m, [&](auto rows) {
      if constexpr (rows < kRows) int8_block<rows, NB>(u + m * Kp, w, out + m * Np, Np, Kp);
    });
}

struct QuantizedRow {
  float scale = 0.f, residual_norm = 0.f, quantized_norm = 0.f, norm = 0.f;
  bool finite = true;
};

// q = round(x / s), s = max|x| / kXLevels, stored as q + kXOffset (padding: q = 0)
QuantizedRow quantize_row(const float* x, uint8_t* u, int64_t K, int64_t Kp) {
  QuantizedRow row;
  float amax = 0.f;
  double sq = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    amax = std::max(amax, std::fabs(x[k]));
    sq += static_cast<double>(x[k]) * x[k];
  }
  row.finite = std::isfinite(sq);  // NaN never wins std::max, but it spreads through sums
  row.norm = static_cast<float>(std::sqrt(sq));
  row.scale = amax > 0.f ? amax / kXLevels : 1.f;
  double residual = 0.0, quantized = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const float q = row.finite ? std::min(kXLevels, std::max(-kXLevels, std::nearbyint(x[k] / row.scale))) : 0.f;
    u[k] = static_cast<uint8_t>(static_cast<int>(q) + kXOffset);
    const double e = static_cast<double>(x[k]) - static_cast<double>(row.scale) * q;
    residual += e * e;
    quantized += static_cast<double>(q) * q;
  }
  std::fill(u + K, u + Kp, static_cast<uint8_t>(kXOffset));
  row.residual_norm = static_cast<float>(std::sqrt(residual));
  row.quantized_norm = static_cast<float>(static_cast<double>(row.scale) * std::sqrt(quantized));
  return row;
}

struct Screen {
  const int32_t* acc;       // one row's int32 sums (with the kXOffset offset)
  const int32_t* offsets;   // kXOffset sum_k p[j][k]
  const float* scales;      // s_j
  const float* norms;       // |w_j|
  const float* residuals;   // |f_j|
  float x_scale, per_norm, per_residual, per_value;

  float value(int64_t j) const {
    return x_scale * scales[j] * static_cast<float>(acc[j] - offsets[j]);
  }
  float bound(int64_t j, float s) const {
    return per_norm * norms[j] + per_residual * residuals[j] + per_value * std::fabs(s) + kTiny;
  }
  // kLanes screened values from j and their bounds (the same roundings as value and bound)
  std::pair<vfloat, vfloat> value_and_bound(int64_t j) const {
    const vint exact = vsub_i32(vload_bits(acc + j), vload_bits(offsets + j));
    const vfloat s = vmul(vset1(x_scale), vmul(vload(scales + j), vcvt_i32(exact)));
    const vfloat b = vadd(vfmadd(vset1(per_norm), vload(norms + j), vmul(vset1(per_residual), vload(residuals + j))),
                          vfmadd(vset1(per_value), vabs(s), vset1(kTiny)));
    return {s, b};
  }
};

// one row: (token, candidates); token -1 where the row is not finite
std::pair<int64_t, int64_t> screen_row(const float* x, const float* w, const Screen& screen, int64_t N, int64_t K) {
  float best_lower = -std::numeric_limits<float>::infinity();
  vfloat lower = vset1(best_lower);
  int64_t j = 0;
  for (; j + kLanes <= N; j += kLanes) {
    const auto [s, b] = screen.value_and_bound(j);
    lower = vmax(lower, vsub(s, b));
  }
  best_lower = vmax_of(lower);
  for (int64_t t = j; t < N; ++t) {
    const float s = screen.value(t);
    best_lower = std::max(best_lower, s - screen.bound(t, s));
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
  const vfloat threshold = vset1(best_lower);
  for (j = 0; j + kLanes <= N; j += kLanes) {
    const auto [s, b] = screen.value_and_bound(j);
    for (uint32_t hits = vge_bits(vadd(s, b), threshold); hits; hits &= hits - 1) check(j + __builtin_ctz(hits));
  }
  for (; j < N; ++j) {
    const float s = screen.value(j);
    if (s + screen.bound(j, s) >= best_lower) check(j);
  }
  return {token, candidates};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> screened_argmax(at::Tensor x, at::Tensor weight, at::Tensor packed,
                                                         at::Tensor scales, at::Tensor norms,
                                                         at::Tensor residuals, at::Tensor sums) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "screened_argmax: x [M, K] fp32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(1) == x.size(1), "screened_argmax: weight [N, K] fp32");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == 64 && packed.size(0) * 16 >= N && packed.size(1) * 4 >= K,
              "screened_argmax: packed [ceil(N/16), ceil(K/4), 64] int8");
  const int64_t Np = packed.size(0) * 16, Kp = packed.size(1) * 4;
  for (const at::Tensor& t : {scales, norms, residuals})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == N,
                "screened_argmax: per-row scales and norms [N] fp32");
  TORCH_CHECK(sums.scalar_type() == at::kInt && sums.is_contiguous() && sums.numel() == N,
              "screened_argmax: weight row sums [N] int32");
  at::Tensor offsets = sums.mul(kXOffset);

  std::vector<uint8_t> u(M * Kp);
  std::vector<QuantizedRow> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = quantize_row(x.data_ptr<float>() + m * K, u.data() + m * Kp, K, Kp);
  at::Tensor products = empty({M, Np}, x.options().dtype(at::kInt));
  int32_t* acc = products.data_ptr<int32_t>();
  const int8_t* p = packed.data_ptr<int8_t>();
  const int64_t groups = Np / 16;
  at::parallel_for(0, (groups + kGroups - 1) / kGroups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t group = t * kGroups;
      if (group + kGroups <= groups) int8_tile<kGroups>(u.data(), p, acc, M, Np, Kp, group);
      else for (int64_t g = group; g < groups; ++g) int8_tile<1>(u.data(), p, acc, M, Np, Kp, g);
    }
  });

  at::Tensor tokens = empty({M}, x.options().dtype(at::kLong));
  at::Tensor candidates = empty({M}, x.options().dtype(at::kLong));
  const double u32 = std::ldexp(1.0, -24), g = K * u32 / (1.0 - K * u32);
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const QuantizedRow& row = rows[m];
      if (!row.finite) {
        tokens.data_ptr<int64_t>()[m] = -1;
        candidates.data_ptr<int64_t>()[m] = 0;
        continue;
      }
      const Screen screen{acc + m * Np, offsets.data_ptr<int32_t>(), scales.data_ptr<float>(),
                          norms.data_ptr<float>(), residuals.data_ptr<float>(), row.scale,
                          static_cast<float>(1.01 * (row.residual_norm + 3 * g * row.norm)),
                          static_cast<float>(1.01 * row.quantized_norm), static_cast<float>(1.01 * 6 * u32)};
      const auto [token, count] = screen_row(x.data_ptr<float>() + m * K, weight.data_ptr<float>(), screen, N, K);
      tokens.data_ptr<int64_t>()[m] = token;
      candidates.data_ptr<int64_t>()[m] = count;
    }
  });
  return {tokens, candidates};
}

bool screened_argmax_available() { return true; }

}  // namespace tokenmill
#else
namespace tokenmill {
std::tuple<at::Tensor, at::Tensor> screened_argmax(at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                                         at::Tensor, at::Tensor, at::Tensor) {
  TORCH_CHECK(false, "screened_argmax: built without AVX512-VNNI or AVX2");
}
bool screened_argmax_available() { return false; }
}  // namespace tokenmill
#endif
