// out = x W^T (+ bias) for 1 to 8 rows of x, W in oneDNN's packed layout: the copy its GEMM
// multiplies by, so that a layer keeps one copy of its weights, not that and a plain one for
// the GEMV (prepacked_linear.py reads the layout off the packed bytes and passes it as a view).
// Blocks of NB = 16 * V output rows, each holding all of K, so a block is one sequential stream:
//   bf16 pairs: [N / NB, K / 2, NB, 2], adjacent k per row (AVX512-BF16's pair layout): one
//         64-byte load gives 16 rows' next pair, which VDPBF16PS multiplies by the broadcast pair
//         of x and adds to 16 fp32 accumulators (each product exact in fp32);
//   lanes: [N / NB, K, NB] of fp32 or bf16 (widened as it is read, under fp32 or bf16 x): one
//         load gives 16 rows' next weight, times the broadcast x[k].
// Each row of x has its own V accumulators, so a weight vector loaded once serves every row:
// the GEMV of a speculative verify step (k + 1 rows) costs little more than one row's where
// the weights stream from memory (on AVX2 cores the FMA rate bounds 5 rows to ~2x one row's).
// On AVX2 cores (8 lanes, V = NB / 8) the lanes layout is also the packed GEMM's panels
// (packed_gemm.cpp: [N / 16, K, 16], fp32 or bf16), which the GEMV reads in place of a plain copy.
#include <ATen/Parallel.h>

#include <algorithm>

#include "attention_math.h"
#include "kernels.h"
#include "vec.h"

namespace tokenmill {

#if defined(TOKENMILL_SIMD)
namespace {

// sums the registers hold beside the weight vectors and a broadcast: 24 of AVX-512's 32, 12 of
// AVX2's 16
#if defined(__AVX512F__)
constexpr int kAccumulators = 24;
#else
constexpr int kAccumulators = 12;
#endif

// rows [m0, m0 + R) of x against blocks b .. b + S - 1: R * S * V accumulators. S > 1 reads S
// blocks as S sequential streams at once: on AVX2 cores the 1-row plain GEMV gained 1.3-1.5x
// from memory with 4 streams (gemv.cpp), where AVX-512 cores measured none
// With Ahead, the next S blocks are prefetched as these are read: S more streams in flight,
// whatever the registers allow.
template <typename T, typename W, bool Pairs, int R, int V, int S, bool Ahead = false>
void block_rows(const T* x, const W* w, const T* bias, T* out, int64_t N, int64_t K, int64_t b, int64_t m0) {
  constexpr int64_t NB = kLanes * V;
  vfloat acc[R][S * V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < S * V; ++v) acc[r][v] = vzero();
  if constexpr (!Pairs) {
    const W* blocks[S];
    for (int s = 0; s < S; ++s) blocks[s] = w + (b + s) * NB * K;
    for (int64_t k = 0; k < K; ++k)
      for (int s = 0; s < S; ++s) {
        if constexpr (Ahead) _mm_prefetch(reinterpret_cast<const char*>(blocks[s] + S * NB * K + k * NB), _MM_HINT_T0);
        vfloat wv[V];
        for (int v = 0; v < V; ++v) wv[v] = vload(blocks[s] + k * NB + v * kLanes);
        for (int r = 0; r < R; ++r) {
          const vfloat xv = vset1(to_float(x[(m0 + r) * K + k]));
          for (int v = 0; v < V; ++v) acc[r][s * V + v] = vfmadd(wv[v], xv, acc[r][s * V + v]);
        }
      }
  } else {
#if defined(__AVX512BF16__)
    static_assert(S == 1, "bf16 blocks are read one at a time");
    const __m512i* block = reinterpret_cast<const __m512i*>(w + b * NB * K);
    const uint32_t* xp[R];
    for (int r = 0; r < R; ++r) xp[r] = reinterpret_cast<const uint32_t*>(x + (m0 + r) * K);
    for (int64_t p = 0; p < K / 2; ++p) {
      __m512bh wv[V];
      for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(block + p * V + v);
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r][p]));
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xv);
      }
    }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < S * V; ++v) {
      alignas(64) float sums[kLanes];
      vstore(sums, acc[r][v]);
      const int64_t n0 = b * NB + v * kLanes;  // block b + v / V, its lanes (v % V) * kLanes on
      T* row = out + (m0 + r) * N + n0;
      for (int i = 0; i < kLanes; ++i)
        row[i] = static_cast<T>(bias != nullptr ? sums[i] + to_float(bias[n0 + i]) : sums[i]);
    }
}

// all M rows of x against block b, as many rows a pass as the accumulators hold (a block's later
// passes read it from L2: NB x K values are 64-360 KB at a 350M model's widths)
template <typename T, typename W, bool Pairs, int V>
void block(const T* x, const W* w, const T* bias, T* out, int64_t M, int64_t N, int64_t K, int64_t b) {
  constexpr int kRowsPerPass = std::max(1, std::min(8, kAccumulators / V));
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass)
    with_constant_1_to_8(std::min<int64_t>(kRowsPerPass, M - m0), [&](auto r) {
      constexpr int R = decltype(r)::value;
      if constexpr (R <= kRowsPerPass) block_rows<T, W, Pairs, R, V, 1>(x, w, bias, out, N, K, b, m0);
    });
}

// vectors per block of 16 rows: 1 on AVX-512, 2 on AVX2 (the packed GEMM's panels)
constexpr int kV16 = std::max<int>(1, 16 / kLanes);

// blocks of 16 rows [begin, end) on AVX2, S at a time as S streams: 1 row of x against 4
// blocks (8 sums); 4 to 6 rows (a verify step's) against one block in one pass (8-12 sums,
// each weight vector read once), the next block prefetched; 2, 3, 7 or 8 rows against 2
// blocks, 3 rows a pass (12 sums), the later passes reading the pair from L2. Returns the
// first block left for block().
template <typename T, typename W>
int64_t streamed_blocks(const T* x, const W* w, const T* bias, T* out, int64_t M, int64_t N, int64_t K,
                        int64_t begin, int64_t end) {
  if constexpr (kLanes == 8) {
    if (M == 1)
      for (; begin + 4 <= end; begin += 4) block_rows<T, W, false, 1, kV16, 4>(x, w, bias, out, N, K, begin, 0);
    else if (M >= 4 && M <= 6)
      for (; begin + 2 <= end; ++begin)
        with_constant_1_to_8(M, [&](auto r) {
          constexpr int R = decltype(r)::value;
          if constexpr (R >= 4 && R <= 6) block_rows<T, W, false, R, kV16, 1, true>(x, w, bias, out, N, K, begin, 0);
        });
    else
      for (; begin + 2 <= end; begin += 2)
        for (int64_t m0 = 0; m0 < M; m0 += 3)
          with_constant_1_to_8(std::min<int64_t>(3, M - m0), [&](auto r) {
            constexpr int R = decltype(r)::value;
            if constexpr (R <= 3) {
              if (m0 == 0 && begin + 4 <= end)  // the first pass reads from memory: 2 more streams
                block_rows<T, W, false, R, kV16, 2, true>(x, w, bias, out, N, K, begin, m0);
              else
                block_rows<T, W, false, R, kV16, 2>(x, w, bias, out, N, K, begin, m0);
            }
          });
  }
  return begin;
}

// Pairs: bf16 blocks [N / NB, K / 2, NB, 2]; else [N / NB, K, NB] of W (bf16 widened as it is read)
template <typename T, typename W, bool Pairs>
void onednn_gemv_typed(const T* x, const W* w, const T* bias, T* out, int64_t M, int64_t N, int64_t K,
                       int64_t blocks, int64_t NB) {
  constexpr int V64 = 64 / kLanes, V32 = 32 / kLanes;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    if constexpr (!Pairs) {
      if (NB == 16) begin = streamed_blocks(x, w, bias, out, M, N, K, begin, end);
    }
    for (int64_t b = begin; b < end; ++b) {
      if (NB == 64) block<T, W, Pairs, V64>(x, w, bias, out, M, N, K, b);
      else if (NB == 32) block<T, W, Pairs, V32>(x, w, bias, out, M, N, K, b);
      else block<T, W, Pairs, kV16>(x, w, bias, out, M, N, K, b);
    }
  });
}

}  // namespace
#endif

std::vector<std::string> onednn_gemv_dtypes() {
  std::vector<std::string> dtypes;
#if defined(TOKENMILL_SIMD)
  dtypes.push_back("float32");
#endif
#if defined(__AVX512BF16__)
  dtypes.push_back("bfloat16");
#endif
  return dtypes;
}

at::Tensor onednn_gemv(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  const bool pairs = weight.dim() == 4, bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.is_contiguous() && ((pairs && bf16 && weight.size(3) == 2) ||
                                         (weight.dim() == 3 && (bf16 || weight.scalar_type() == at::kFloat))),
              "onednn_gemv: a contiguous bf16 weight [N / NB, K / 2, NB, 2], or bf16 or fp32 [N / NB, K, NB]");
  const int64_t NB = weight.size(2), N = weight.size(0) * NB, K = weight_cols(weight);
  TORCH_CHECK(NB == 16 || NB == 32 || NB == 64, "onednn_gemv: blocks of 16, 32 or 64 output rows");
#if !defined(TOKENMILL_SIMD)
  TORCH_CHECK(false, "onednn_gemv: not built on this CPU (no AVX2 or AVX-512)");
#elif !defined(__AVX512BF16__)
  TORCH_CHECK(!pairs, "onednn_gemv: bf16 pairs need AVX512-BF16");
#endif
  TORCH_CHECK((x.scalar_type() == weight.scalar_type() || (x.scalar_type() == at::kFloat && bf16 && !pairs)) &&
                  x.is_contiguous() && x.size(-1) == K,
              "onednn_gemv: contiguous x of the weight's width, in its dtype (or float32 over bf16 blocks)");
  const int64_t rows = x.numel() / K;
  TORCH_CHECK(rows >= 1 && rows <= 8, "onednn_gemv: 1 to 8 rows");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == N),
              "onednn_gemv: bias [N] in x's dtype");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = empty(sizes, x.options());
#if defined(TOKENMILL_SIMD)
  auto run = [&](auto* x_tag, auto* w_tag, auto pairs_tag) {
    using T = std::remove_pointer_t<decltype(x_tag)>;
    using W = std::remove_pointer_t<decltype(w_tag)>;
    onednn_gemv_typed<T, W, decltype(pairs_tag)::value>(x.data_ptr<T>(), weight.data_ptr<W>(),
                                                        has_bias ? bias->data_ptr<T>() : nullptr,
                                                        out.data_ptr<T>(), rows, N, K, weight.size(0), NB);
  };
  using Bf16 = c10::BFloat16;
  if (pairs) {
#if defined(__AVX512BF16__)
    run(static_cast<Bf16*>(nullptr), static_cast<Bf16*>(nullptr), std::true_type{});
#endif
  } else if (!bf16) {
    run(static_cast<float*>(nullptr), static_cast<float*>(nullptr), std::false_type{});
  } else if (x.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr), static_cast<Bf16*>(nullptr), std::false_type{});
  } else {
    run(static_cast<Bf16*>(nullptr), static_cast<Bf16*>(nullptr), std::false_type{});
  }
#endif
  return out;
}

}  // namespace tokenmill
