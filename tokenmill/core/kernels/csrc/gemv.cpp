// out = x W^T (+ bias) for 1 to 4 rows of x, W the plain [N, K] row-major weight.
//
// Decode at batch 1-4 is bound by reading the weights once per step. W is read
// as one sequential stream (row after row, four accumulators along k), which the
// hardware prefetcher follows at the memory's bandwidth where oneDNN's prepacked
// GEMM stays at ~15 GB/s (350M-model shapes, cold weights). Software prefetches
// ahead of the stream (4 KB, tried from 512 B to 8 KB) made it 1.1-1.2x slower
// on the AVX-512 host once weights sit on huge pages (core/huge_pages.py), and
// slower on 4 KB pages too. Accumulation is fp32; bf16 x bf16 uses the AVX512-BF16
// pair dot product where the CPU has it (each product exact in fp32), else widens both.
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec.h"

namespace tokenmill {
namespace {

constexpr int64_t kUnroll = 4;              // accumulators per row of x

// Bytes ahead of the weight stream to prefetch in software: only bf16 weights on CPUs without
// AVX-512. There (Zen 3) a 16-bit stream ran at 12-14 GB/s against fp32's 14-17 (more
// instructions per byte, so fewer cache misses in flight); prefetching 1 KB ahead gave 14-15.5
// (512 B to 8 KB tried). fp32 weights there, and any weights on the AVX-512 host, ran slower.
template <typename W>
constexpr int64_t kPrefetchAhead =
#if defined(__AVX512F__)
    0;
#else
    sizeof(W) == 2 ? 1024 : 0;
#endif

template <typename T, typename W, int M>
void gemv_rows(const T* x, const W* w, const T* bias, T* out, int64_t N, int64_t K, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const W* wr = w + n * K;
    float sums[M] = {};
    int64_t k = 0;
#if defined(TOKENMILL_SIMD)
    if constexpr (kVectorized<T> && kVectorized<W>) {
      constexpr int64_t lanes = kDotStep<T, W>;  // elements per dot step
      constexpr int64_t step = lanes * kUnroll;
      vfloat acc[M][kUnroll];
      for (int m = 0; m < M; ++m)
        for (int u = 0; u < kUnroll; ++u) acc[m][u] = vzero();
      for (; k + step <= K; k += step) {
        if constexpr (kPrefetchAhead<W> > 0) __builtin_prefetch(reinterpret_cast<const char*>(wr + k) + kPrefetchAhead<W>);
        for (int u = 0; u < kUnroll; ++u)
          for (int m = 0; m < M; ++m) acc[m][u] = dot_step(acc[m][u], x + m * K + k + u * lanes, wr + k + u * lanes);
      }
      for (int m = 0; m < M; ++m) sums[m] = vsum(vadd(vadd(acc[m][0], acc[m][1]), vadd(acc[m][2], acc[m][3])));
    }
#endif
    for (int m = 0; m < M; ++m) {
      float sum = sums[m];
      for (int64_t j = k; j < K; ++j) sum += to_float(x[m * K + j]) * to_float(wr[j]);
      if (bias != nullptr) sum += to_float(bias[n]);
      out[m * N + n] = static_cast<T>(sum);
    }
  }
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
