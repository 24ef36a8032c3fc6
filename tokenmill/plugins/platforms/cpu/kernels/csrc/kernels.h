// The kernels' entry points, for the Python bindings and for kernels that call each other.
// ATen's tensors only (aten.h): pybind11 is parsed by bindings.cpp alone.
#pragma once

#include "aten.h"

#include <string>
#include <tuple>
#include <vector>

namespace tokenmill {
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_table, at::Tensor seq_lens,
                            at::Tensor query_rows, double scale, int64_t window, double soft_cap);
void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                             at::Tensor value_cache, at::Tensor block_table, at::Tensor seq_lens,
                             at::Tensor query_start, at::Tensor seqs, double scale, int64_t window);
std::vector<std::string> prefill_dtypes();
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void silu_and_mul(at::Tensor out, at::Tensor x);
void rotary_embedding(at::Tensor query, at::Tensor key, at::Tensor cos, at::Tensor sin);
at::Tensor pack_gemm_weight(at::Tensor weight);
at::Tensor packed_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias);
bool packed_gemm_preferred();
at::Tensor gemv(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);
at::Tensor onednn_gemv(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);
std::vector<std::string> onednn_gemv_dtypes();
// a weight's output and input sizes: [N, K] plain, or oneDNN's packed layouts (onednn_gemv.cpp):
// bf16 [N / NB, K / 2, NB, 2], fp32 [N / NB, K, NB]
inline int64_t weight_rows(const at::Tensor& w) { return w.dim() == 2 ? w.size(0) : w.size(0) * w.size(2); }
inline int64_t weight_cols(const at::Tensor& w) { return w.dim() == 4 ? w.size(1) * 2 : w.size(1); }
std::tuple<at::Tensor, at::Tensor> screened_argmax(at::Tensor x, at::Tensor weight, at::Tensor packed,
                                                         at::Tensor scales, at::Tensor norms,
                                                         at::Tensor residuals, at::Tensor sums);
bool screened_argmax_available();
int64_t parallel_threads();
}  // namespace tokenmill
