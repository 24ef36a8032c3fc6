// All decoder layers of a Llama-style model for a few query rows (1-2 decode rows, or a
// speculative verify step's k + 1 rows), in one call.
//
// At batch 1 a step reads every weight once and little else; what the eager
// layers add around those reads is ~14 Python-level ops per layer, each run with
// caches the weight stream has just flushed (350M model: ~9 ms of a ~44 ms step
// besides the GEMVs, against ~4 ms when the weights are not streamed). This runs
// the same kernels in the same order as the eager layers do with fused ops on
// (rms_norm, gemv, rotary_embedding, paged_decode_attention, silu_and_mul), so
// its output is bit-identical to theirs, without returning to Python between them.
//
// A verify step's row j sees its request's context up to its own position: every row's K/V is
// written to the cache before any row attends, so the causal mask is the rows' lengths (as
// sequences of their own, or per request in the prompt-chunk kernel: decode_stack.h).
#include "decode_stack.h"

#include <cstring>
#include <numeric>

#include "kernels.h"
#include "vec.h"

namespace tokenmill {

namespace {

// cache[slots[r]] = row r of src (rows strided, each kv_heads * head_dim contiguous values), rounded
// to the cache's dtype (a bf16 cache.kv_cache_dtype); a slot < 0 is not written
void write_cache(at::Tensor& cache, const at::Tensor& src, const int64_t* slots, int64_t rows) {
  if (cache.scalar_type() != src.scalar_type()) {
    const int64_t row_size = cache.size(2) * cache.size(3);
    at::Tensor flat = cache.view({-1, row_size}), from = src.reshape({rows, row_size});
    for (int64_t r = 0; r < rows; ++r)
      if (slots[r] >= 0) flat[slots[r]].copy_(from[r]);
    return;
  }
  const int64_t row_bytes = cache.stride(1) * cache.element_size();
  char* base = static_cast<char*>(cache.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  const int64_t src_stride = src.stride(0) * src.element_size();
  for (int64_t r = 0; r < rows; ++r)
    if (slots[r] >= 0) std::memcpy(base + slots[r] * row_bytes, from + r * src_stride, row_bytes);
}

}  // namespace

void DecodeStack::add_layer(at::Tensor input_norm, double norm_eps, at::Tensor qkv,
                            c10::optional<at::Tensor> qkv_bias, at::Tensor o, c10::optional<at::Tensor> o_bias,
                            at::Tensor post_norm, double post_norm_eps, at::Tensor gate_up,
                            c10::optional<at::Tensor> gate_up_bias, at::Tensor down,
                            c10::optional<at::Tensor> down_bias, at::Tensor key_cache, at::Tensor value_cache,
                            double scale, int64_t window) {
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  TORCH_CHECK(weight_rows(qkv) == q_size + 2 * kv_size && weight_cols(o) == q_size, "decode stack: q/k/v sizes");
  TORCH_CHECK(weight_rows(gate_up) == 2 * weight_cols(down), "decode stack: gate_up is [2 * intermediate, hidden]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4 &&
                  key_cache.size(2) * key_cache.size(3) == kv_size,
              "decode stack: caches [blocks, block_size, kv_heads, head_dim]");
  layers_.push_back(Layer{input_norm, post_norm, qkv, o, gate_up, down, qkv_bias, o_bias, gate_up_bias,
                          down_bias, key_cache, value_cache, norm_eps, post_norm_eps, scale, window});
}

at::Tensor DecodeStack::forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                  at::Tensor block_table, at::Tensor seq_lens,
                                  c10::optional<at::Tensor> query_start) {
  const int64_t rows = x.size(0);
  TORCH_CHECK(x.dim() == 2 && rows >= 1 && rows <= 8, "decode stack: 1 to 8 rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == rows, "decode stack: one int64 slot per row");
  const bool by_request = query_start.has_value();
  const int64_t seqs = by_request ? query_start->numel() - 1 : rows;
  TORCH_CHECK(seq_lens.numel() == seqs && block_table.size(0) == seqs,
              "decode stack: one sequence per row, or per request with query_start");
  TORCH_CHECK(!by_request || (query_start->scalar_type() == at::kInt &&
                              query_start->data_ptr<int32_t>()[seqs] == rows),
              "decode stack: query_start int32, ending at the rows");
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const int64_t* slot = slots.data_ptr<int64_t>();
  // the decode kernel's row of each sequence, or the prompt-chunk kernel's list of sequences
  at::Tensor query_rows = empty({seqs}, slots.options());
  std::iota(query_rows.data_ptr<int64_t>(), query_rows.data_ptr<int64_t>() + seqs, int64_t{0});
  at::Tensor residual = x.clone();
  at::Tensor normed = empty(x.sizes(), x.options());
  at::Tensor attn = empty({rows, num_heads_, head_dim_}, x.options());
  for (Layer& layer : layers_) {
    rms_norm(normed, residual, layer.input_norm, layer.norm_eps);
    at::Tensor qkv = gemv(normed, layer.qkv, layer.qkv_bias);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads_, head_dim_});
    rotary_embedding(q, k, cos, sin);
    write_cache(layer.key_cache, k, slot, rows);
    write_cache(layer.value_cache, qkv.narrow(1, q_size + kv_size, kv_size), slot, rows);
    if (by_request)
      paged_prefill_attention(attn, q.contiguous(), layer.key_cache, layer.value_cache, block_table, seq_lens,
                              *query_start, query_rows, layer.scale, layer.window);
    else
      paged_decode_attention(attn, q.contiguous(), layer.key_cache, layer.value_cache, block_table, seq_lens,
                             query_rows, layer.scale, layer.window, 0.0);
    residual.add_(gemv(attn.view({rows, q_size}), layer.o, layer.o_bias));
    rms_norm(normed, residual, layer.post_norm, layer.post_norm_eps);
    at::Tensor gate_up = gemv(normed, layer.gate_up, layer.gate_up_bias);
    at::Tensor act = empty({rows, gate_up.size(1) / 2}, x.options());
    silu_and_mul(act, gate_up);
    residual.add_(gemv(act, layer.down, layer.down_bias));
  }
  return residual;
}

}  // namespace tokenmill
