// The fused decode stack (decode_stack.cpp), declared here for its Python binding (bindings.cpp),
// so that only bindings.cpp parses pybind11's headers.
#pragma once

#include "aten.h"

#include <vector>

namespace tokenmill {

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {}

  void add_layer(at::Tensor input_norm, double norm_eps, at::Tensor qkv, c10::optional<at::Tensor> qkv_bias,
                 at::Tensor o, c10::optional<at::Tensor> o_bias, at::Tensor post_norm, double post_norm_eps,
                 at::Tensor gate_up, c10::optional<at::Tensor> gate_up_bias, at::Tensor down,
                 c10::optional<at::Tensor> down_bias, at::Tensor key_cache, at::Tensor value_cache,
                 double scale, int64_t window);

  // x: [rows, hidden], the embeddings; returns the residual stream after the last layer
  // (before the final norm). cos/sin: [rows, rotary_dim]; slots: [rows] int64.
  // Without query_start, block_table/seq_lens have one sequence per row (a decode row; or a
  // verify row as a sequence of its own: its request's table, the context up to and including
  // the row's own token). With query_start ([requests + 1] int32: a verify step's rows, several
  // per request), they have one per request, and the prompt-chunk kernel (paged_prefill.cpp)
  // attends, reading each request's keys and values once for all its rows.
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                        at::Tensor block_table, at::Tensor seq_lens, c10::optional<at::Tensor> query_start);

 private:
  struct Layer {
    at::Tensor input_norm, post_norm, qkv, o, gate_up, down;
    c10::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
    at::Tensor key_cache, value_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
    double norm_eps, post_norm_eps, scale;
    int64_t window;
  };

  int64_t num_heads_, num_kv_heads_, head_dim_;
  std::vector<Layer> layers_;
};

}  // namespace tokenmill
