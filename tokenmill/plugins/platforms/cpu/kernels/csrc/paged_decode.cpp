// Decode attention (one query token per sequence) read in place from the paged KV cache.
//
// Why a kernel: in PyTorch ops each sequence needs its blocks gathered into a
// contiguous buffer and its own SDPA call; at decode batch sizes that is a
// copy of the whole context plus ~100 us of call overhead per sequence and
// layer. This walks each sequence's block table directly, reading every key and
// value row once for all heads (GQA groups share it).
//
// Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] (the cpu and
// torch backends' layout). Scores and softmax are fp32 whatever the cache dtype, which is the
// query's, or bf16 under fp32 queries (cache.kv_cache_dtype: half the bytes read per step).
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "attention_math.h"

namespace tokenmill {
namespace {

// Whether bf16 q.k can use the AVX512-BF16 pair dot product directly on the raw bf16
// query (each product exact in fp32): half the instructions of widening both sides.
template <typename T>
constexpr bool kBf16Dot =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

template <typename T>
inline void axpy(float p, const T* v, float* acc, int64_t n) {
#if defined(TOKENMILL_SIMD)
  if (n % kLanes == 0) {
    const vfloat pv = vset1(p);
    for (int64_t d = 0; d < n; d += kLanes) vstore(acc + d, vfmadd(pv, vload(v + d), vload(acc + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < n; ++d) acc[d] += p * to_float(v[d]);
}

// The cache lines of a tile's rows, prefetched a few at a time from inside the loops that
// compute on the current tile: a whole tile's lines at once stall on the fill buffers. Into L2
// (prefetcht1), not L1: a core has far fewer L1 miss buffers than L2 ones, and prefetches into
// L1 capped a sequence's reads from DRAM at ~11 GB/s where the core streams ~27 (Zen 4; into L2:
// ~18-19 GB/s, 1.7x). (Row and line are stepped, not divided out: a 64-bit division per line was
// most of the kernel's time when the rows were already cached.)
template <typename T>
struct LinePrefetcher {
  LinePrefetcher(const T* const* rows, int64_t count, int64_t row_bytes, int64_t slots)
      : rows(rows), count(count), lines(row_bytes / 64), per_slot((count * lines + slots - 1) / slots) {}
  // the next per_slot lines (one slot's share)
  void next() {
    for (int64_t k = 0; k < per_slot && row < count; ++k) {
      __builtin_prefetch(reinterpret_cast<const char*>(rows[row]) + line * 64, 0, 2);
      if (++line == lines) {
        line = 0;
        ++row;
      }
    }
  }
  const T* const* rows;
  int64_t count, lines, per_slot, row = 0, line = 0;
};

#if defined(__AVX512BF16__)
// bf16 sequences with head_dim % 32 == 0, in tiles of up to 16 tokens (one cache block at the
// usual block size). Per token the generic loops (decode_kernel) spend most of their time on a horizontal
// sum per head (q.k) and on loading, widening and storing the fp32 accumulator per head (p.v):
// here 16 partial dot products are reduced together by one transpose-and-add, and each head's
// accumulator stays in registers for a whole tile, widening v with one shift (even lanes) or
// mask (odd lanes) per 16 values: 7-22% less time per call than the generic loops (16/8 heads of
// 64, 1-64 sequences of 200-2000 tokens); what remains is mostly memory stalls on scattered blocks.
//
// Tiles outermost, so that each tile's rows (all KV heads) are read from memory once, while
// the next tile's are prefetched; acc: [num_heads][kChunks][even 16 | odd 16] fp32.
template <int64_t kChunks>  // head_dim / 32
void decode_seq_bf16_tiled(const c10::BFloat16* q, const c10::BFloat16* const* k_rows,
                           const c10::BFloat16* const* v_rows, int64_t n, int64_t num_heads, int64_t group,
                           int64_t row_bytes, float scale, double soft_cap, float* scores, float* acc,
                           c10::BFloat16* out) {
  constexpr int64_t head_dim = kChunks * 32;
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t tn = std::min(kTile, n - t0);
    const int64_t next = std::min(kTile, n - t0 - tn);
    const __mmask16 valid = static_cast<__mmask16>((1u << tn) - 1);
    LinePrefetcher<c10::BFloat16> prefetch(k_rows + t0 + tn, next, row_bytes, num_heads * kTile);
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t kv_offset = (h / group) * head_dim;
      __m512 part[kTile];
      for (int64_t i = 0; i < kTile; ++i) {
        prefetch.next();
        part[i] = _mm512_setzero_ps();
        if (i >= tn) continue;
        const c10::BFloat16* k = k_rows[t0 + i] + kv_offset;
        for (int64_t c = 0; c < kChunks; ++c)
          part[i] = _mm512_dpbf16_ps(part[i], (__m512bh)_mm512_loadu_si512(q + h * head_dim + c * 32),
                                     (__m512bh)_mm512_loadu_si512(k + c * 32));
      }
      _mm512_mask_storeu_ps(scores + h * n + t0, valid,
                            _mm512_mul_ps(vsum_transposed(part), _mm512_set1_ps(scale)));
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    float* s = scores + h * n;
    const float inv_sum = softmax_unnormalized(s, n, soft_cap);
    for (int64_t t = 0; t < n; ++t) s[t] *= inv_sum;
  }
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t tn = std::min(kTile, n - t0);
    const int64_t next = std::min(kTile, n - t0 - tn);
    LinePrefetcher<c10::BFloat16> prefetch(v_rows + t0 + tn, next, row_bytes, num_heads * tn);
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t kv_offset = (h / group) * head_dim;
      float* a = acc + h * head_dim;
      __m512 even[kChunks], odd[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) {
        even[c] = _mm512_loadu_ps(a + c * 32);
        odd[c] = _mm512_loadu_ps(a + c * 32 + 16);
      }
      const float* p = scores + h * n + t0;
      for (int64_t i = 0; i < tn; ++i) {
        prefetch.next();
        const __m512 pi = _mm512_set1_ps(p[i]);
        const c10::BFloat16* v = v_rows[t0 + i] + kv_offset;
        for (int64_t c = 0; c < kChunks; ++c) {
          const Pair x = load_pair(v + c * 32);
          even[c] = _mm512_fmadd_ps(pi, x.a, even[c]);
          odd[c] = _mm512_fmadd_ps(pi, x.b, odd[c]);
        }
      }
      for (int64_t c = 0; c < kChunks; ++c) {
        _mm512_storeu_ps(a + c * 32, even[c]);
        _mm512_storeu_ps(a + c * 32 + 16, odd[c]);
      }
    }
  }
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t c = 0; c < kChunks; ++c)
      store_pair(out + h * head_dim + c * 32, load_pair(acc + h * head_dim + c * 32));
}
#endif

#if defined(TOKENMILL_SIMD)
// Any cache type with vector loads (fp32; bf16 and fp16 widened in registers), head_dim a
// multiple of kLanes. The row-at-a-time loop below ends each head's q.k with a horizontal sum
// and keeps its p.v accumulators in memory: ~100 cycles per head and token on a Zen 3 core
// whether the cache was fp32 or bf16, so it ran at 15 GB/s (fp32) and 7 GB/s (bf16) from L2.
// Here q.k sums a tile of kTile keys' partial products (one q vector in a register serves the
// tile) reduced by one transpose, and p.v keeps kSlice vectors of a head's accumulator in
// registers over the tile. q: the scaled fp32 query [num_heads][head_dim]; acc: fp32
// [num_heads][head_dim], left unnormalized (times inv_sum[h] is the output).
template <typename T, int64_t kSlice>  // accumulator vectors per pass over a head (<= 8)
void decode_seq_tiled(const float* q, const T* const* k_rows, const T* const* v_rows, int64_t n, int64_t num_heads,
                      int64_t group, int64_t head_dim, int64_t row_bytes, double soft_cap, float* scores, float* acc,
                      float* inv_sum) {
  const int64_t vecs = head_dim / kLanes;
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t tn = std::min(kTile, n - t0);
    LinePrefetcher<T> prefetch(k_rows + t0 + tn, std::min(kTile, n - t0 - tn), row_bytes, num_heads * vecs);
    // a short last tile repeats its first key (not stored below): no branch in the inner loop
    const T* keys[kTile];
    for (int64_t i = 0; i < kTile; ++i) keys[i] = k_rows[t0 + (i < tn ? i : 0)];
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t kv_offset = (h / group) * head_dim;
      vfloat part[kTile];
      for (int64_t i = 0; i < kTile; ++i) part[i] = vzero();
      for (int64_t c = 0; c < vecs; ++c) {
        prefetch.next();
        const vfloat qc = vload(q + h * head_dim + c * kLanes);
        const int64_t at = kv_offset + c * kLanes;
        for (int64_t i = 0; i < kTile; ++i) part[i] = vfmadd(qc, vload(keys[i] + at), part[i]);
      }
      vstore_masked(scores + h * n + t0, vrange(0, tn), vsum_transposed(part));
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) inv_sum[h] = softmax_unnormalized(scores + h * n, n, soft_cap);
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t tn = std::min(kTile, n - t0);
    LinePrefetcher<T> prefetch(v_rows + t0 + tn, std::min(kTile, n - t0 - tn), row_bytes, num_heads * vecs / kSlice);
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t kv_offset = (h / group) * head_dim;
      const float* p = scores + h * n + t0;
      for (int64_t c0 = 0; c0 < vecs; c0 += kSlice) {
        prefetch.next();
        float* a = acc + h * head_dim + c0 * kLanes;
        vfloat sum[kSlice];
        for (int64_t c = 0; c < kSlice; ++c) sum[c] = vload(a + c * kLanes);
        for (int64_t i = 0; i < tn; ++i) {
          const vfloat pi = vset1(p[i]);
          const T* v = v_rows[t0 + i] + kv_offset + c0 * kLanes;
          for (int64_t c = 0; c < kSlice; ++c) sum[c] = vfmadd(pi, vload(v + c * kLanes), sum[c]);
        }
        for (int64_t c = 0; c < kSlice; ++c) vstore(a + c * kLanes, sum[c]);
      }
    }
  }
}

// accumulator vectors per pass of decode_seq_tiled: the whole head where it fits in 8
inline int64_t slice_vectors(int64_t vecs) {
  if (vecs <= 8) return vecs;
  for (int64_t slice : {8, 4, 2}) if (vecs % slice == 0) return slice;
  return 1;
}
#endif

template <typename Q, typename T>  // query and output, cache
void decode_kernel(const Q* query, const T* key_cache, const T* value_cache, const int32_t* block_table,
                   const int32_t* seq_lens, const int64_t* query_rows, Q* out, int64_t num_seqs,
                   int64_t max_blocks, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, double scale, int64_t window, double soft_cap) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_row_stride = num_heads * head_dim;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  // bf16 with AVX512-BF16: the bf16 pair-dot path (head_dim a multiple of 32, up to 256); any
  // other cache type on a vector build: decode_seq_tiled. Both prefetch the next tile while
  // computing on this one (the tiled bf16 pass without it ran slower than the row loop on Zen 3:
  // 8 rows read a head's slice at a time lose the hardware prefetcher). The row-at-a-time loop
  // (no vectors, or head_dim not a multiple of kLanes) leaves reads to the hardware prefetcher.
  const bool tiled = kBf16Dot<T> && std::is_same_v<Q, T> && head_dim % 32 == 0 && head_dim <= 256;
#if defined(TOKENMILL_SIMD)
  const bool generic_tiled = !tiled && head_dim % kLanes == 0;
#else
  const bool generic_tiled = false;
#endif
  const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(T));
  // One task per sequence: a token's keys for all KV heads are one contiguous row,
  // so the cache is read as whole rows, in block order.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(num_heads * head_dim), acc(num_heads * head_dim), scores, inv_sum(num_heads);
    std::vector<const T*> k_rows, v_rows;
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = seq_lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const Q* q_src = query + query_rows[seq] * q_row_stride;
      scores.resize(num_heads * n);
      const int32_t* table = block_table + seq * max_blocks;
      auto row = [&](const T* cache, int64_t pos) {
        return cache + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
      };
      if (tiled || generic_tiled) {  // the rows' addresses, a block at a time
        k_rows.resize(n);
        v_rows.resize(n);
        for (int64_t t = 0; t < n;) {
          const int64_t pos = first + t, offset = pos % block_size;
          const int64_t at = table[pos / block_size] * block_stride + offset * token_stride;
          for (int64_t end = std::min(n, t + block_size - offset), j = 0; t < end; ++t, ++j) {
            k_rows[t] = key_cache + at + j * token_stride;
            v_rows[t] = value_cache + at + j * token_stride;
          }
        }
      }
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, T>) {
        if (tiled) {
          auto run = [&](auto chunks) {
            decode_seq_bf16_tiled<decltype(chunks)::value>(
                q_src, k_rows.data(), v_rows.data(), n, num_heads, group, row_bytes, static_cast<float>(scale),
                soft_cap, scores.data(), acc.data(), out + query_rows[seq] * q_row_stride);
          };
          with_constant_1_to_8(head_dim / 32, run);
          continue;
        }
      }
#endif
      for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = to_float(q_src[i]) * static_cast<float>(scale);
      if (generic_tiled) {
#if defined(TOKENMILL_SIMD)
        auto run = [&](auto slice) {
          decode_seq_tiled<T, decltype(slice)::value>(q.data(), k_rows.data(), v_rows.data(), n, num_heads, group,
                                                      head_dim, row_bytes, soft_cap, scores.data(), acc.data(),
                                                      inv_sum.data());
        };
        with_constant_1_to_8(slice_vectors(head_dim / kLanes), run);
#endif
      } else {
        // scores[h][t] = q_h . k_t (head h reads KV head h / group)
        for (int64_t t = 0; t < n; ++t) {
          const T* k_row = row(key_cache, first + t);
          for (int64_t kv = 0, h = 0; kv < num_kv_heads; ++kv)
            for (int64_t g = 0; g < group; ++g, ++h)
              scores[h * n + t] = dot(q.data() + h * head_dim, k_row + kv * head_dim, head_dim);
        }
        for (int64_t h = 0; h < num_heads; ++h) inv_sum[h] = softmax_unnormalized(scores.data() + h * n, n, soft_cap);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < n; ++t) {
          const T* v_row = row(value_cache, first + t);
          for (int64_t kv = 0, h = 0; kv < num_kv_heads; ++kv)
            for (int64_t g = 0; g < group; ++g, ++h)
              axpy(scores[h * n + t], v_row + kv * head_dim, acc.data() + h * head_dim, head_dim);
        }
      }
      Q* o = out + query_rows[seq] * q_row_stride;
      for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d) o[h * head_dim + d] = static_cast<Q>(acc[h * head_dim + d] * inv_sum[h]);
    }
  });
}

}  // namespace

// query/out: [num_tokens, num_heads, head_dim]; rows of out not in query_rows are left untouched.
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_table, at::Tensor seq_lens,
                            at::Tensor query_rows, double scale, int64_t window, double soft_cap) {
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous(), "query and out must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(), "block_table: int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "seq_lens: int32");
  TORCH_CHECK(query_rows.scalar_type() == at::kLong, "query_rows: int64");
  const bool mixed = bf16_cache_under_fp32("paged_decode_attention", out, query, key_cache, value_cache);
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  auto run = [&](auto* query_tag, auto* cache_tag) {
    using Q = std::remove_pointer_t<decltype(query_tag)>;
    using T = std::remove_pointer_t<decltype(cache_tag)>;
    decode_kernel<Q, T>(query.data_ptr<Q>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
                        block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), query_rows.data_ptr<int64_t>(),
                        out.data_ptr<Q>(), seq_lens.size(0), block_table.size(1), block_size, num_heads, num_kv_heads,
                        head_dim, scale, window, soft_cap);
  };
  auto same = [&](auto* tag) { run(tag, tag); };
  if (mixed) return run(static_cast<float*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
  switch (query.scalar_type()) {
    case at::kFloat: same(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: same(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: same(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16 only");
  }
}

}  // namespace tokenmill
