// Prompt-chunk attention (many query tokens per sequence) read in place from the paged KV
// cache: fp32 and bf16, on AVX-512 or AVX2 (vec.h); head_dim a multiple of 32 up to 256.
//
// PyTorch's fused SDPA runs these at ~25-28 GFLOP/s here (16/8 heads of 64, 256-token
// prompts, causal), and needs each sequence's blocks gathered first. This kernel works on
// blocks of rows that share one KV head: up to 8 (query token, head) rows at once, so that
// each key and value row loaded from the cache serves all of them. q.k sums a tile of keys'
// partial products (16 with AVX-512, 8 with AVX2) in as many registers, reduced by one
// transpose (bf16 with AVX512-BF16: the pair dot product on raw bf16, exact products); softmax is fp32; p.v keeps the rows' fp32 accumulators in registers and
// loads (bf16: widens) each value vector once for all of them. 53 GFLOP/s fp32 and 61 bf16 at
// the shapes above (was 38 and 54 before q.k walked key tiles outermost and the softmax tails
// were vectorized); head_dim 128, 1024-token prompts: 74 fp32.
#include <ATen/Parallel.h>

#include <array>
#include <vector>

#include "kernels.h"
#include "attention_math.h"

namespace tokenmill {
namespace {

#if defined(TOKENMILL_SIMD)
constexpr int64_t kMaxRows = 8;  // (query token, head) rows per block: 2 x 8 accumulators per kPair values

// out[m][offset, offset + kPair) = sum over t of p[m][t] * v_t[offset, offset + kPair)
template <typename Q, typename T, int64_t M>
void pv_chunk(const float* p, int64_t p_stride, const T* const* v_rows, int64_t n, int64_t offset, Q* const* out) {
  Pair acc[M];
  for (int64_t m = 0; m < M; ++m) acc[m] = {vzero(), vzero()};
  for (int64_t t = 0; t < n; ++t) {
    const Pair v = load_pair_for<Q>(v_rows[t] + offset);
    for (int64_t m = 0; m < M; ++m) {
      const vfloat pm = vset1(p[m * p_stride + t]);
      acc[m].a = vfmadd(pm, v.a, acc[m].a);
      acc[m].b = vfmadd(pm, v.b, acc[m].b);
    }
  }
  for (int64_t m = 0; m < M; ++m) store_pair(out[m] + offset, acc[m]);
}

// One block: rows m = (query token j0 + m / group, head kv_head * group + m % group) at positions
// row_pos[m]; k_rows/v_rows: that KV head's rows of positions lo, lo + 1, ... row_pos[rows - 1].
template <typename Q, typename T, int64_t kChunks>  // query and output, cache; head_dim / 32
void prefill_block(const Q* query, int64_t q_row_stride, const T* const* k_rows, const T* const* v_rows, int64_t lo,
                   const int64_t* row_pos, int64_t rows, int64_t group, int64_t kv_head, int64_t j0, float scale,
                   int64_t window, float* scores, Q* out) {
  constexpr int64_t head_dim = kChunks * 32;
  const int64_t n = row_pos[rows - 1] + 1 - lo;  // rows are in position order
  Q* out_rows[kMaxRows];
  const Q* q_rows[kMaxRows];
  int64_t first[kMaxRows], last[kMaxRows];  // each row's keys, relative to lo; the rest get p = 0
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t offset = (j0 + m / group) * q_row_stride + (kv_head * group + m % group) * head_dim;
    out_rows[m] = out + offset;
    q_rows[m] = query + offset;
    last[m] = row_pos[m] - lo;
    first[m] = window > 0 ? std::max<int64_t>(0, row_pos[m] + 1 - window - lo) : 0;
  }
  // Key tiles outermost, rows inside: a tile's keys (16 x head_dim values) stay in L1 while
  // every row uses them; rows outermost re-read all keys from L2 per row, and q.k ran at
  // a third of the FMA peak.
  for (int64_t t0 = first[0]; t0 <= last[rows - 1]; t0 += kTile) {
    const int64_t tn = std::min(kTile, last[rows - 1] + 1 - t0);
    // a short last tile repeats its first key (masked out below): no branch in the unrolled loop
    const T* keys[kTile];
    for (int64_t i = 0; i < kTile; ++i) keys[i] = k_rows[t0 + (i < tn ? i : 0)];
    for (int64_t m = 0; m < rows; ++m) {
      if (t0 > last[m] || t0 + kTile <= first[m]) continue;
      // head_dim outermost: one q vector in a register serves the whole tile
      constexpr int64_t step = kDotStep<Q, T>;
      vfloat part[kTile];
      for (int64_t i = 0; i < kTile; ++i) part[i] = vzero();
      for (int64_t d = 0; d < head_dim; d += step)
        for (int64_t i = 0; i < kTile; ++i) part[i] = dot_step(part[i], q_rows[m] + d, keys[i] + d);
      // lanes first[m] - t0 .. last[m] - t0 of this tile
      const int64_t from = std::max<int64_t>(0, first[m] - t0), to = std::min<int64_t>(kTile, last[m] + 1 - t0);
      vstore_masked(scores + m * n + t0, vrange(from, to), vmul(vsum_transposed(part), vset1(scale)));
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    float* s = scores + m * n;
    const float inv_sum = softmax_unnormalized(s + first[m], last[m] + 1 - first[m], 0.0);
    for (int64_t t = first[m]; t <= last[m]; ++t) s[t] *= inv_sum;
    std::fill(s, s + first[m], 0.f);
    std::fill(s + last[m] + 1, s + n, 0.f);
  }
  for (int64_t offset = 0; offset < head_dim; offset += kPair) {
    auto run = [&](auto m) { pv_chunk<Q, T, decltype(m)::value>(scores, n, v_rows, n, offset, out_rows); };
    with_constant_1_to_8(rows, run);
  }
}

template <typename Q, typename T>
void prefill_kernel(const Q* q, const T* kc, const T* vc, const int32_t* table, const int32_t* lens,
                    const int32_t* starts, const int64_t* seq_ids, int64_t num_seqs, Q* o, int64_t max_blocks,
                    int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                    int64_t window) {
  const int64_t group = num_heads / num_kv_heads, tokens_per_block = kMaxRows / group;
  const int64_t token_stride = num_kv_heads * head_dim, q_row_stride = num_heads * head_dim;
  // work items: (sequence, kv head, block of query tokens)
  std::vector<std::array<int64_t, 3>> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t s = seq_ids[i], q_len = starts[s + 1] - starts[s];
    for (int64_t kv = 0; kv < num_kv_heads; ++kv)
      for (int64_t j = 0; j < q_len; j += tokens_per_block) items.push_back({s, kv, j});
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<const T*> k_rows, v_rows;
    std::vector<float> scores;
    for (int64_t w = begin; w < end; ++w) {
      const auto [s, kv, j] = items[w];
      const int64_t q_len = starts[s + 1] - starts[s], len = lens[s];
      const int64_t rows = std::min(tokens_per_block, q_len - j) * group;
      int64_t row_pos[kMaxRows];
      for (int64_t m = 0; m < rows; ++m) row_pos[m] = len - q_len + j + m / group;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, row_pos[0] + 1 - window) : 0;
      const int64_t n = row_pos[rows - 1] + 1 - lo;
      k_rows.resize(n);
      v_rows.resize(n);
      const int32_t* blocks = table + s * max_blocks;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = lo + t;
        const int64_t offset = (blocks[pos / block_size] * block_size + pos % block_size) * token_stride + kv * head_dim;
        k_rows[t] = kc + offset;
        v_rows[t] = vc + offset;
      }
      scores.resize(rows * n);
      auto run = [&](auto chunks) {
        prefill_block<Q, T, decltype(chunks)::value>(q + starts[s] * q_row_stride, q_row_stride, k_rows.data(),
                                                  v_rows.data(), lo, row_pos, rows, group, kv, j,
                                                  static_cast<float>(scale), window, scores.data(),
                                                  o + starts[s] * q_row_stride);
      };
      with_constant_1_to_8(head_dim / 32, run);
    }
  });
}
#endif

}  // namespace

std::vector<std::string> prefill_dtypes() {
#if defined(TOKENMILL_SIMD)
  return {"float32", "bfloat16"};
#else
  return {};
#endif
}

// query/out: [num_tokens, num_heads, head_dim]. For each sequence s in `seqs`, its query rows
// query_start[s]..query_start[s + 1] are its last tokens (of seq_lens[s]), already in the
// cache. Rows of out outside those sequences are left untouched.
void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                             at::Tensor value_cache, at::Tensor block_table, at::Tensor seq_lens,
                             at::Tensor query_start, at::Tensor seqs, double scale, int64_t window) {
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && block_table.is_contiguous(),
              "paged_prefill_attention: contiguous tensors");
  const bool mixed = bf16_cache_under_fp32("paged_prefill_attention", out, query, key_cache, value_cache);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start.scalar_type() == at::kInt && seqs.scalar_type() == at::kLong,
              "paged_prefill_attention: int32 tables, int64 sequence list");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(head_dim % 32 == 0 && head_dim <= 256 && key_cache.size(3) == head_dim,
              "paged_prefill_attention: head_dim a multiple of 32 up to 256");
  TORCH_CHECK(num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 8,
              "paged_prefill_attention: 1 to 8 query heads per KV head");
  bool done = false;
#if defined(TOKENMILL_SIMD)
  auto run = [&](auto* query_tag, auto* cache_tag) {
    using Q = std::remove_pointer_t<decltype(query_tag)>;
    using T = std::remove_pointer_t<decltype(cache_tag)>;
    prefill_kernel<Q, T>(query.data_ptr<Q>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
                         block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                         query_start.data_ptr<int32_t>(), seqs.data_ptr<int64_t>(), seqs.numel(), out.data_ptr<Q>(),
                         block_table.size(1), block_size, num_heads, num_kv_heads, head_dim, scale, window);
    done = true;
  };
  if (mixed) run(static_cast<float*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
  else if (query.scalar_type() == at::kFloat) run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else if (query.scalar_type() == at::kBFloat16)
    run(static_cast<c10::BFloat16*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
#endif
  TORCH_CHECK(done, "paged_prefill_attention: ", query.scalar_type(), " is not built on this CPU (see prefill_dtypes)");
}

}  // namespace tokenmill
