// out = x W^T (+ bias) for 1 to 8 rows of x, W the plain [N, K] row-major weight.
//
// Decode at batch 1-4 is bound by reading the weights once per step. W is read as a
// few sequential streams (kMaxStreams below), which the hardware prefetcher follows
// where oneDNN's prepacked GEMM stays at ~15 GB/s (350M-model shapes, cold weights).
// Software prefetches ahead of a stream (512 B to 8 KB) made it 1.1-1.2x slower on
// the AVX-512 host once weights sit on huge pages (core/huge_pages.py), and slower on
// 4 KB pages too; on Zen 3 1 KB ahead of one bf16 stream gained 10-15%, which the
// streams below more than replace. Accumulation is fp32; bf16 x bf16 uses the AVX512-BF16
// pair dot product where the CPU has it (each product exact in fp32), else widens both.
//
// 3-8 rows are a speculative verify step (k + 1 query rows of a request) in the fused decode
// stack; they, and 2 rows on AVX-512 (where one stream is read), take gemv_block below.
#include <ATen/Parallel.h>

#include <algorithm>

#include "attention_math.h"
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

// Weight rows n0 .. n0 + NB - 1 against all M rows of x: one accumulator per (x row, weight row)
// pair, so each weight vector is loaded once for the M rows and each x vector once for the NB
// weight rows. The per-row streams above ran M rows in about M times one row's time (each x row
// re-read for every weight row): 3-3.5x at 5 rows on a Zen 4. Unlike the 1-row streams, the
// blocks prefetch the next block's rows as they go: without it the demo model's 5-row verify
// step took 1.6-2.1 ms against 0.75-0.89 ms with it (Zen 4, each FMA waiting on its weight load).
template <typename T, typename W, int64_t M, int NB>
void gemv_block(const T* x, const W* w, const T* bias, T* out, int64_t N, int64_t K, int64_t n0) {
  float sums[M * NB] = {};  // [m][b]
  int64_t k = 0;
#if defined(TOKENMILL_SIMD)
  if constexpr (kVectorized<T> && kVectorized<W>) {
    constexpr int64_t lanes = kDotStep<T, W>;
    vfloat acc[M * NB];
    for (int64_t i = 0; i < M * NB; ++i) acc[i] = vzero();
    for (; k + lanes <= K; k += lanes) {
      for (int b = 0; b < NB; ++b) {
        for (int64_t m = 0; m < M; ++m) acc[m * NB + b] = dot_step(acc[m * NB + b], x + m * K + k, w + (n0 + b) * K + k);
        __builtin_prefetch(w + (n0 + NB + b) * K + k, 0, 1);  // the next block's rows, a block ahead
      }
    }
    // kLanes accumulators reduced at once (one horizontal sum each was ~40% of a block's time at
    // the width of a small model's layers)
    for (int64_t first = 0; first < M * NB; first += kLanes) {
      vfloat group[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) group[i] = first + i < M * NB ? acc[first + i] : vzero();
      float reduced[kLanes];
      vstore(reduced, vsum_transposed(group));
      for (int64_t i = 0; i < kLanes && first + i < M * NB; ++i) sums[first + i] = reduced[i];
    }
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) {
      const int64_t n = n0 + b;
      float sum = sums[m * NB + b];
      for (int64_t j = k; j < K; ++j) sum += to_float(x[m * K + j]) * to_float(w[n * K + j]);
      if (bias != nullptr) sum += to_float(bias[n]);
      out[m * N + n] = static_cast<T>(sum);
    }
}

// weight rows [begin, end) for 2-8 rows of x. With AVX-512: blocks of 4 weight rows for 2-3 rows
// of x (8-12 FMA chains), of 2 from 4 rows on. Measured on a Zen 4, the demo model's decode stack
// (4.3M fp32 parameters, in L3) at 5 rows: 2 weight rows a block 680-820 us, 3: 750-990, 4: 910,
// 1: 1380, against 280-300 us for a 1-row step; 2 rows of a 2816 x 512 fp32 weight: 32 us in
// blocks of 4, 55 us as two streams. AVX2 has 16 vector registers: M * NB sums and NB weight
// vectors fit (x is an FMA's memory operand). On a Zen 3 (1 thread, the demo model's four layers,
// three runs taking turns on a noisy host, each the median of 300 passes) blocks of 2 for 4-7 rows
// and of 4 for 3 ran 5 rows in 1381, 1194, 839 us against 1822, 1536, 965 with one weight row a
// block, and 3 rows in 909, 871, 540 against 1127, 1252, 1016 with blocks of 2.
template <typename T, typename W, int64_t M>
void gemv_blocks(const T* x, const W* w, const T* bias, T* out, int64_t N, int64_t K, int64_t begin, int64_t end) {
#if defined(__AVX512F__)
  constexpr int NB = M <= 3 ? 4 : 2;
#else
  constexpr int NB = M <= 3 ? 4 : (M <= 7 ? 2 : 1);
#endif
  int64_t n = begin;
  for (; n + NB <= end; n += NB) gemv_block<T, W, M, NB>(x, w, bias, out, N, K, n);
  for (; n < end; ++n) gemv_block<T, W, M, 1>(x, w, bias, out, N, K, n);
}

template <typename T, typename W>
void gemv_typed(const T* x, const W* w, const T* bias, T* out, int64_t rows, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    with_constant_1_to_8(rows, [&](auto m) {
      constexpr int64_t M = decltype(m)::value;
      if constexpr (M == 1 || (M == 2 && kMaxStreams > 1))
        gemv_rows<T, W, M>(x, w, bias, out, N, K, begin, end);
      else
        gemv_blocks<T, W, M>(x, w, bias, out, N, K, begin, end);
    });
  });
}

}  // namespace

// x and the output in x's dtype; the weight in x's dtype, or bf16 under fp32 x (weights whose
// values are bf16, kept at half the bytes: batch-1 decode streams them, and widening bf16 is
// exact, so the result is the fp32 GEMV's). A 3-D or 4-D weight is oneDNN's packed layout
// (onednn_gemv.cpp).
at::Tensor gemv(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  if (weight.dim() != 2) return onednn_gemv(x, weight, bias);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "gemv: contiguous x and weight");
  const bool widened = x.scalar_type() == at::kFloat && weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() || widened,
              "gemv: the weight in x's dtype (or bfloat16 under float32 x)");
  const int64_t K = weight.size(1), N = weight.size(0), rows = x.numel() / K;
  TORCH_CHECK(x.size(-1) == K && rows >= 1 && rows <= 8, "gemv: 1 to 8 rows of the weight's width");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous()), "gemv: bias");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = empty(sizes, x.options());
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
    case at::kFloat: run(static_cast<float*>(nullptr), static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr), static_cast<c10::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "gemv: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace tokenmill
