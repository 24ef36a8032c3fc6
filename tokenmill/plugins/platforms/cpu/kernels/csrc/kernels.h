// The kernels' entry points, for the Python bindings and for kernels that call each other.
// torch/types.h, not torch/extension.h: the units that need pybind11 (bindings.cpp,
// decode_stack.cpp) include that themselves, and its headers cost each unit ~11 s to parse.
#pragma once

#include <torch/types.h>

#include <string>
#include <tuple>
#include <vector>

namespace tokenmill {
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                            torch::Tensor query_rows, double scale, int64_t window, double soft_cap);
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                             torch::Tensor query_start, torch::Tensor seqs, double scale, int64_t window);
std::vector<std::string> prefill_dtypes();
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void silu_and_mul(torch::Tensor out, torch::Tensor x);
void rotary_embedding(torch::Tensor query, torch::Tensor key, torch::Tensor cos, torch::Tensor sin);
torch::Tensor pack_gemm_weight(torch::Tensor weight);
torch::Tensor packed_gemm(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);
bool packed_gemm_preferred();
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor onednn_gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
std::vector<std::string> onednn_gemv_dtypes();
// a weight's output and input sizes: [N, K] plain, or oneDNN's packed layouts (onednn_gemv.cpp):
// bf16 [N / NB, K / 2, NB, 2], fp32 [N / NB, K, NB]
inline int64_t weight_rows(const torch::Tensor& w) { return w.dim() == 2 ? w.size(0) : w.size(0) * w.size(2); }
inline int64_t weight_cols(const torch::Tensor& w) { return w.dim() == 4 ? w.size(1) * 2 : w.size(1); }
std::tuple<torch::Tensor, torch::Tensor> screened_argmax(torch::Tensor x, torch::Tensor weight, torch::Tensor packed,
                                                         torch::Tensor scales, torch::Tensor norms,
                                                         torch::Tensor residuals, torch::Tensor sums);
bool screened_argmax_available();
int64_t parallel_threads();
}  // namespace tokenmill
