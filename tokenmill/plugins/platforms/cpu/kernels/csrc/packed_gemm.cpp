// out = x W^T (+ bias) in fp32 for any number of rows, W packed once at load into panels of
// kPanel output columns: [ceil(N / kPanel), K, kPanel], each k's kPanel weights contiguous.
// The panels are fp32, or bf16 for a weight that is bf16 (a bf16 checkpoint computed in fp32:
// half the bytes), widened exactly: as the tile reads them for fewer than kWidenRows rows (a
// GEMM that memory bounds), a panel at a time into an fp32 scratch for more (the widening then
// costs nothing next to the chunk's arithmetic).
//
// Why not oneDNN: on AVX2-only CPUs (AMD Zen 3 here) oneDNN's prepacked fp32 GEMM and MKL's
// sgemm run the model's shapes at 60-73 GFLOP/s of the core's 122 (measured with a 10-chain
// FMA loop); this register-tiled kernel runs them at 75-92. Each call packs x's rows in
// blocks of kRowTile ([K, kRowTile] per block, the broadcasts then read one stream), and the
// micro-kernel keeps a kRowTile x kPanel tile of sums in registers over all of K (12 of the 16
// AVX2 registers, two weight vectors, one broadcast): per k, 2 weight loads and kRowTile
// broadcasts feed 2 kRowTile FMAs. Each panel (K x kPanel weights) passes over a chunk of
// kChunkRows of x's packed rows while it sits in L1/L2, then the next chunk: a prompt chunk of
// 4096 rows is 8-16 MB of x (K = 512-1024), which every panel streamed from memory when it
// passed over all rows; in chunks of 384 rows the GEMMs of the 52M and 350M models ran
// 1.02-1.22x faster at 4096 rows (1 thread, Zen 3, in one process), the same at 128. Splitting
// K into blocks of 256 or 512 as well (the sums reloaded between blocks) gained nothing more.
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "kernels.h"
#include "vec.h"

namespace tokenmill {
namespace {

#if defined(TOKENMILL_SIMD)
constexpr int64_t kPanel = 2 * kLanes;              // output columns per packed panel
constexpr int64_t kRowTile = kLanes == 8 ? 6 : 14;  // x rows per register tile (16 or 32 registers)
constexpr int64_t kChunkRows = 64 * kRowTile;        // x rows all panels pass over before the next rows
constexpr int64_t kWidenRows = 64;                   // chunks of this many rows widen a bf16 panel first
#define TOKENMILL_UNROLL _Pragma("GCC unroll 16")

// out[r, 0:kPanel] = sum_k a[k * R + r] b[k * kPanel + 0:kPanel] (+ bias), for R rows.
// R is a compile-time constant and every loop over it unrolled: a runtime index into the sums
// makes the compiler keep them in memory (2.5x slower).
template <int R, typename W>
void tile(const float* __restrict a, const W* __restrict b, const float* bias, float* out, int64_t ldo,
          int64_t K, int64_t columns) {
  vfloat sum[R][2];
  TOKENMILL_UNROLL for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const vfloat b0 = vload(b + k * kPanel), b1 = vload(b + k * kPanel + kLanes);
    TOKENMILL_UNROLL for (int r = 0; r < R; ++r) {
      const vfloat x = vset1(a[k * R + r]);
      sum[r][0] = vfmadd(x, b0, sum[r][0]);
      sum[r][1] = vfmadd(x, b1, sum[r][1]);
    }
  }
  if (columns == kPanel) {
    const vfloat bias0 = bias ? vload(bias) : vzero(), bias1 = bias ? vload(bias + kLanes) : vzero();
    TOKENMILL_UNROLL for (int r = 0; r < R; ++r) {
      vstore(out + r * ldo, vadd(sum[r][0], bias0));
      vstore(out + r * ldo + kLanes, vadd(sum[r][1], bias1));
    }
    return;
  }
  float row[kPanel];  // the last panel, narrower than kPanel
  TOKENMILL_UNROLL for (int r = 0; r < R; ++r) {
    vstore(row, sum[r][0]);
    vstore(row + kLanes, sum[r][1]);
    for (int64_t j = 0; j < columns; ++j) out[r * ldo + j] = row[j] + (bias ? bias[j] : 0.f);
  }
}

template <int R, typename W>
void tile_rows(int64_t rows, const float* a, const W* b, const float* bias, float* out, int64_t ldo, int64_t K,
               int64_t columns) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1>(rows, a, b, bias, out, ldo, K, columns);
  }
  tile<R>(a, b, bias, out, ldo, K, columns);
}
#undef TOKENMILL_UNROLL

// rows [0, M) of x into blocks of kRowTile rows, each [K, rows in block] (the last may be short)
void pack_rows(const float* x, float* packed, int64_t M, int64_t K) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
    const int64_t rows = std::min(kRowTile, M - m0);
    float* block = packed + m0 * K;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) block[k * rows + r] = x[(m0 + r) * K + k];
  }
}
#else
constexpr int64_t kPanel = 16;
#endif

// every row of x against panels [begin, end), the panels' chunks of kChunkRows rows in turn
template <typename W>
void gemm_panels(const float* a, const W* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                 int64_t begin, int64_t end) {
#if defined(TOKENMILL_SIMD)
  // 64-byte aligned, as the fp32 panels are (a vector's 16-byte alignment split every other load: 7% slower)
  at::Tensor scratch = empty({std::is_same_v<W, float> ? 0 : K * kPanel}, at::TensorOptions().dtype(at::kFloat));
  float* wide = scratch.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows)
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = p * kPanel, columns = std::min(kPanel, N - n), m1 = std::min(M, m0 + kChunkRows);
      auto rows = [&](const auto* panel) {
        for (int64_t m = m0; m < m1; m += kRowTile)
          tile_rows<kRowTile>(std::min(kRowTile, m1 - m), a + m * K, panel, b ? b + n : nullptr, y + m * N + n, N,
                              K, columns);
      };
      const W* panel = w + p * K * kPanel;
      if (std::is_same_v<W, float> || m1 - m0 < kWidenRows) {
        rows(panel);
        continue;
      }
      for (int64_t i = 0; i < K * kPanel; i += kLanes) vstore(wide + i, vload(panel + i));
      rows(static_cast<const float*>(wide));
    }
#else
  for (int64_t n = begin * kPanel; n < std::min(N, end * kPanel); ++n)
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += a[m * K + k] * to_float(w[(n / kPanel) * K * kPanel + k * kPanel + n % kPanel]);
      y[m * N + n] = sum + (b ? b[n] : 0.f);
    }
#endif
}

}  // namespace

at::Tensor pack_gemm_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_gemm_weight: weight [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  const auto dtype = weight.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
  at::Tensor padded = empty({panels * kPanel, K}, weight.options().dtype(dtype)).zero_();
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

at::Tensor packed_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "packed_gemm: contiguous float32 x");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && (bf16 || packed.scalar_type() == at::kFloat) && packed.is_contiguous() &&
                  packed.size(2) == kPanel && packed.size(1) > 0 && packed.size(0) * kPanel >= N && N > packed.size(0) * kPanel - kPanel,
              "packed_gemm: weight from pack_gemm_weight, float32 or bfloat16 [ceil(N / ", kPanel, "), K, ", kPanel, "]");
  const int64_t K = packed.size(1);
  TORCH_CHECK(x.size(-1) == K, "packed_gemm: x has ", x.size(-1), " features, the weight ", K);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "packed_gemm: float32 bias [N]");
  const int64_t M = x.numel() / K;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = empty(sizes, x.options());
  if (M == 0 || N == 0) return out;
  const float* b = has_bias ? bias->data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
#if defined(TOKENMILL_SIMD)
  at::Tensor rows = empty({M * K}, x.options());
  float* a = rows.data_ptr<float>();
  pack_rows(x.data_ptr<float>(), a, M, K);
#else
  const float* a = x.data_ptr<float>();
#endif
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    if (bf16) gemm_panels(a, packed.data_ptr<c10::BFloat16>(), b, y, M, N, K, begin, end);
    else gemm_panels(a, packed.data_ptr<float>(), b, y, M, N, K, begin, end);
  });
  return out;
}

// Where this kernel replaces oneDNN's: measured faster on AVX2-only CPUs; on AVX-512 ones
// oneDNN's kernels (not measured against this one there) stay.
bool packed_gemm_preferred() {
#if defined(TOKENMILL_SIMD) && !defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace tokenmill
