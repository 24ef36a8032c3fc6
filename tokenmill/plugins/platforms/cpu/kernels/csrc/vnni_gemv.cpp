// out = x W^T (+ bias) for 1 to 8 bf16 rows of x, W in oneDNN's packed bf16 layout: the copy
// its GEMM multiplies by, so that a layer keeps one copy of its weights, not that and a plain
// one for the GEMV (prepacked_linear.py reads the layout off the packed bytes and passes it as a
// [N / NB, K / 2, NB, 2] view). Blocks of NB output rows, each holding all of K as pairs of
// adjacent k for each of the NB rows (AVX512-BF16's pair layout): a block is one sequential
// stream, and one 64-byte load gives 16 rows' next pair, which VDPBF16PS multiplies by the
// broadcast pair of x and adds to 16 fp32 accumulators (each product exact in fp32).
#include <ATen/Parallel.h>

#include <algorithm>

#include "attention_math.h"
#include "kernels.h"
#include "vec.h"

namespace tokenmill {

#if defined(__AVX512BF16__)
namespace {

// rows [m0, m0 + R) of x against block b (NB = 16 * V output rows): R * V accumulators, at most 16
template <int R, int V>
void vnni_block_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
                     int64_t N, int64_t K, int64_t b, int64_t m0) {
  constexpr int64_t NB = 16 * V;
  const int64_t pairs = K / 2;
  const __m512i* block = reinterpret_cast<const __m512i*>(w + b * NB * K);
  const uint32_t* xp[R];
  for (int r = 0; r < R; ++r) xp[r] = reinterpret_cast<const uint32_t*>(x + (m0 + r) * K);
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(block + p * V + v);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r][p]));
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      alignas(64) float sums[16];
      _mm512_store_ps(sums, acc[r][v]);
      const int64_t n0 = b * NB + v * 16;
      c10::BFloat16* row = out + (m0 + r) * N + n0;
      for (int i = 0; i < 16; ++i)
        row[i] = static_cast<c10::BFloat16>(bias != nullptr ? sums[i] + to_float(bias[n0 + i]) : sums[i]);
    }
}

// all M rows of x against block b, at most 16 / V rows a pass (the block's later passes read it
// from L2: NB x K bf16 is 64-360 KB at a 350M model's widths)
template <int V>
void vnni_block(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
                int64_t M, int64_t N, int64_t K, int64_t b) {
  constexpr int kRowsPerPass = 16 / V;
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass)
    with_constant_1_to_8(std::min<int64_t>(kRowsPerPass, M - m0), [&](auto r) {
      constexpr int R = decltype(r)::value;
      if constexpr (R <= kRowsPerPass) vnni_block_rows<R, V>(x, w, bias, out, N, K, b, m0);
    });
}

}  // namespace
#endif

bool vnni_gemv_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor vnni_gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(vnni_gemv_available(), "vnni_gemv: built without AVX512-BF16");
  TORCH_CHECK(weight.dim() == 4 && weight.size(3) == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == torch::kBFloat16,
              "vnni_gemv: a contiguous bf16 weight [N / NB, K / 2, NB, 2]");
  const int64_t NB = weight.size(2), N = weight.size(0) * NB, K = weight.size(1) * 2;
  TORCH_CHECK(NB == 16 || NB == 32 || NB == 64, "vnni_gemv: blocks of 16, 32 or 64 output rows");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.size(-1) == K,
              "vnni_gemv: contiguous bf16 x of the weight's width");
  const int64_t rows = x.numel() / K;
  TORCH_CHECK(rows >= 1 && rows <= 8, "vnni_gemv: 1 to 8 rows");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == N),
              "vnni_gemv: bias [N] bf16");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  torch::Tensor out = torch::empty(sizes, x.options());
#if defined(__AVX512BF16__)
  const auto* xs = x.data_ptr<c10::BFloat16>();
  const auto* ws = weight.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bs = has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto* os = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, weight.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (NB == 64) vnni_block<4>(xs, ws, bs, os, rows, N, K, b);
      else if (NB == 32) vnni_block<2>(xs, ws, bs, os, rows, N, K, b);
      else vnni_block<1>(xs, ws, bs, os, rows, N, K, b);
    }
  });
#endif
  return out;
}

}  // namespace tokenmill
