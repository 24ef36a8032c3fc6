// out = x W^T (+ bias) for 1 to 4 rows of x, W the plain [N, K] row-major weight.
//
// Decode at batch 1-4 is bound by reading the weights once per step. W is read as a
// few sequential streams (kMaxStreams below), which the hardware prefetcher follows
// where oneDNN's prepacked GEMM stays at ~15 GB/s (350M-model shapes, cold weights).
// Software prefetches ahead of a stream (512 B to 8 KB) made it 1.1-1.2x slower on
// the AVX-512 host once weights sit on huge pages (core/huge_pages.py), and slower on
// 4 KB pages too; on Zen 3 1 KB ahead of one bf16 stream gained 10-15%, which the
// streams below more than replace. Accumulation is fp32; bf16 x bf16 uses the AVX512-BF16
// pair dot product where the CPU has it (each product exact in fp32), else widens both.
#include <ATen/Parallel.h>

#include <algorithm>

#include "kernels.h"
#include "vec.h"

namespace tokenmill {
namespace {

// Weight rows read at once, as separate sequential streams: a task's rows are split into
// kMaxStreams / M contiguous ranges (M: rows of x), one row of each per pass. On Zen 3 (AVX2, 1
// thread, the 350M model's weights on huge pages) the core keeps more cache misses in flight
// across streams than the hardware prefetcher does along one: 1 row of x, bf16 weights 14.5 ->
// 21.7 GB/s, fp32 15.5 -> 20.6; 2 rows (2 streams) bf16 13.5 -> 16.2, fp32 13.1 -> 18.4.
// Adjacent rows as the streams (2 KB apart) ran at 9-12. On AVX-512 cores 2-8 rows read at once
// measured no gain (benchmarks/README.md): one stream stays there.
#if defined(__AVX512F__)
constexpr int kMaxStreams = 1;
#else
constexpr int kMaxStreams = 4;
#endif

// rows first + s * stride (s < S) of out = x W^T (+ bias); kUnroll accumulators per (x row,
// stream) pair along k, 4 for a single stream (its only source of independent FMA chains)
template <typename T, typename W, int M, int S>
void gemv_streams(const T* x, const W* w, const T* bias, T* out, int64_t N, int64_t K, int64_t first, int64_t stride) {
  constexpr int kUnroll = S == 1 ? 4 : 2;
  const W* wr[S];
  for (int s = 0; s < S; ++s) wr[s] = w + (first + s * stride) * K;
  float sums[M][S] = {};
  int64_t k = 0;
#if defined(TOKENMILL_SIMD)
  if constexpr (kVectorized<T> && kVectorized<W>) {
    constexpr int64_t lanes = kDotStep<T, W>;  // elements per dot step
    constexpr int64_t step = lanes * kUnroll;
    vfloat acc[M][S][kUnroll];
    for (int m = 0; m < M; ++m)
      for (int s = 0; s < S; ++s)
        for (int u = 0; u < kUnroll; ++u) acc[m][s][u] = vzero();
    for (; k + step <= K; k += step)
      for (int u = 0; u < kUnroll; ++u)
        for (int s = 0; s < S; ++s)
          for (int m = 0; m < M; ++m)
            acc[m][s][u] = dot_step(acc[m][s][u], x + m * K + k + u * lanes, wr[s] + k + u * lanes);
    for (int m = 0; m < M; ++m)
      for (int s = 0; s < S; ++s) {
        vfloat total = acc[m][s][0];
        for (int u = 1; u < kUnroll; ++u) total = vadd(total, acc[m][s][u]);
        sums[m][s] = vsum(total);
      }
  }
#endif
  for (int m = 0; m < M; ++m)
    for (int s = 0; s < S; ++s) {
      const int64_t n = first + s * stride;
      float sum = sums[m][s];
      for (int64_t j = k; j < K; ++j) sum += to_float(x[m * K + j]) * to_float(wr[s][j]);
      if (bias != nullptr) sum += to_float(bias[n]);
      out[m * N + n] = static_cast<T>(sum);
    }
}

// rows [begin, end): S streams of (end - begin) / S rows each, the rest one at a time
template <typename T, typename W, int M>
void gemv_rows(const T* x, const W* w, const T* bias, T* out, int64_t N, int64_t K, int64_t begin, int64_t end) {
  constexpr int S = std::max(1, kMaxStreams / M);
  const int64_t per_stream = (end - begin) / S;
  for (int64_t i = 0; i < per_stream; ++i) gemv_streams<T, W, M, S>(x, w, bias, out, N, K, begin + i, per_stream);
  for (int64_t n = begin + S * per_stream; n < end; ++n) gemv_streams<T, W, M, 1>(x, w, bias, out, N, K, n, 0);
}

template <typename T, typename W>
void gemv_typed(const T* x, const W* w, const T* bias, T* out, int64_t rows, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    switch (rows) {
      case 1: gemv_rows<T, W, 1>(x, w, bias, out, N, K, begin, end); break;
      case 2: gemv_rows<T, W, 2>(x, w, bias, out, N, K, begin, end); break;
      case 3: gemv_rows<T, W, 3>(x, w, bias, out, N, K, begin, end); break;
      default: gemv_rows<T, W, 4>(x, w, bias, out, N, K, begin, end); break;
    }
  });
}

}  // namespace

// x and the output in x's dtype; the weight in x's dtype, or bf16 under fp32 x (weights whose
// values are bf16, kept at half the bytes: batch-1 decode streams them, and widening bf16 is
// exact, so the result is the fp32 GEMV's)
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "gemv: contiguous x and weight");
  const bool widened = x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() || widened,
              "gemv: the weight in x's dtype (or bfloat16 under float32 x)");
  const int64_t K = weight.size(1), N = weight.size(0), rows = x.numel() / K;
  TORCH_CHECK(x.size(-1) == K && rows >= 1 && rows <= 4, "gemv: 1 to 4 rows of the weight's width");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous()), "gemv: bias");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  torch::Tensor out = torch::empty(sizes, x.options());
  auto run = [&](auto* x_tag, auto* w_tag) {
    using T = std::remove_pointer_t<decltype(x_tag)>;
    using W = std::remove_pointer_t<decltype(w_tag)>;
    gemv_typed<T, W>(x.data_ptr<T>(), weight.data_ptr<W>(), has_bias ? bias->data_ptr<T>() : nullptr,
                     out.data_ptr<T>(), rows, N, K);
  };
  if (widened) {
    run(static_cast<float*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
    return out;
  }
  switch (x.scalar_type()) {
    case torch::kFloat: run(static_cast<float*>(nullptr), static_cast<float*>(nullptr)); break;
    case torch::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr), static_cast<c10::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "gemv: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace tokenmill
