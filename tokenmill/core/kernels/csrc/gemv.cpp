// out = x W^T (+ bias) for 1 to 4 rows of x, W the plain [N, K] row-major weight.
//
// Decode at batch 1-4 is bound by reading the weights once per step. W is read
// as one sequential stream (row after row, four accumulators along k), which the
// hardware prefetcher follows at the memory's bandwidth where oneDNN's prepacked
// GEMM stays at ~15 GB/s (350M-model shapes, cold weights). Software prefetches
// ahead of the stream (4 KB, tried from 512 B to 8 KB) made it 1.1-1.2x slower
// on this project's CPU once weights sit on huge pages (core/huge_pages.py), and
// slower on 4 KB pages too. Accumulation is fp32; bf16 uses the AVX512-BF16 pair
// dot product (each product exact in fp32).
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec.h"

namespace tokenmill {
namespace {

constexpr int64_t kUnroll = 4;              // accumulators per row of x

#if defined(__AVX512F__)
// acc += the products of one vector's worth of x and w
inline __m512 fma_chunk(__m512 acc, const float* x, const float* w) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(w), acc);
}
#if defined(__AVX512BF16__)
inline __m512 fma_chunk(__m512 acc, const c10::BFloat16* x, const c10::BFloat16* w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_loadu_si512(w));
}
#endif
#endif

template <typename T, int M>
void gemv_rows(const T* x, const T* w, const T* bias, T* out, int64_t N, int64_t K, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const T* wr = w + n * K;
    float sums[M] = {};
    int64_t k = 0;
#if defined(__AVX512F__)
    if constexpr (kVectorized<T>) {
      constexpr int64_t lanes = 64 / sizeof(T);  // elements per 64-byte vector (and cache line)
      constexpr int64_t step = lanes * kUnroll;
      __m512 acc[M][kUnroll];
      for (int m = 0; m < M; ++m)
        for (int u = 0; u < kUnroll; ++u) acc[m][u] = _mm512_setzero_ps();
      for (; k + step <= K; k += step) {
        for (int u = 0; u < kUnroll; ++u)
          for (int m = 0; m < M; ++m) acc[m][u] = fma_chunk(acc[m][u], x + m * K + k + u * lanes, wr + k + u * lanes);
      }
      for (int m = 0; m < M; ++m)
        sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                                     _mm512_add_ps(acc[m][2], acc[m][3])));
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

template <typename T>
void gemv_typed(const T* x, const T* w, const T* bias, T* out, int64_t rows, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    switch (rows) {
      case 1: gemv_rows<T, 1>(x, w, bias, out, N, K, begin, end); break;
      case 2: gemv_rows<T, 2>(x, w, bias, out, N, K, begin, end); break;
      case 3: gemv_rows<T, 3>(x, w, bias, out, N, K, begin, end); break;
      default: gemv_rows<T, 4>(x, w, bias, out, N, K, begin, end); break;
    }
  });
}

}  // namespace

torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "gemv: contiguous x and weight");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "gemv: x and weight dtypes differ");
  const int64_t K = weight.size(1), N = weight.size(0), rows = x.numel() / K;
  TORCH_CHECK(x.size(-1) == K && rows >= 1 && rows <= 4, "gemv: 1 to 4 rows of the weight's width");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous()), "gemv: bias");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  torch::Tensor out = torch::empty(sizes, x.options());
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gemv_typed<T>(x.data_ptr<T>(), weight.data_ptr<T>(), has_bias ? bias->data_ptr<T>() : nullptr,
                  out.data_ptr<T>(), rows, N, K);
  };
  switch (x.scalar_type()) {
    case torch::kFloat: run(static_cast<float*>(nullptr)); break;
    case torch::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "gemv: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace tokenmill
