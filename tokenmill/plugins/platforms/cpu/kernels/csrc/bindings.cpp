// pybind11 with torch's tensor casters, not torch/extension.h, which adds torch's whole C++
// frontend (modules, optimizers, data loaders): 23 s to compile the bindings against 54 on a
// 2.45 GHz Zen 3 core. The decode stack, the greedy head and the layer ops compile in this
// unit, not in all_kernels.cpp, so that the build's two units take about equal time (see
// all_kernels.cpp).
#include <torch/csrc/utils/pybind.h>

#include "decode_stack.h"
#include "kernels.h"

#include "decode_stack.cpp"
#include "layer_ops.cpp"
#include "screened_argmax.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &tokenmill::paged_decode_attention,
        "decode attention (one query row per sequence) over a paged KV cache");
  m.def("rms_norm", &tokenmill::rms_norm, "out = weight * x / rms(x), fp32 math");
  m.def("gemv", &tokenmill::gemv,
        "x W^T (+ bias) for 1 to 8 rows of x, W plain [N, K] or oneDNN's packed layout "
        "(bf16 [N / NB, K / 2, NB, 2], fp32 [N / NB, K, NB])",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("onednn_gemv_dtypes", &tokenmill::onednn_gemv_dtypes,
        "the dtypes whose oneDNN packed layout gemv reads on this CPU (fp32: AVX-512; bf16: AVX512-BF16)");
  m.def("pack_gemm_weight", &tokenmill::pack_gemm_weight, "a [N, K] weight as fp32 panels for packed_gemm");
  m.def("packed_gemm", &tokenmill::packed_gemm, "fp32 x W^T (+ bias), W from pack_gemm_weight, any number of rows",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("packed_gemm_preferred", &tokenmill::packed_gemm_preferred,
        "whether packed_gemm is used instead of oneDNN on this CPU (AVX2 without AVX-512)");
  m.def("rotary_embedding", &tokenmill::rotary_embedding, "NeoX rotary in place on query and key");
  m.def("silu_and_mul", &tokenmill::silu_and_mul, "out = silu(gate) * up for x = [gate | up]");
  m.def("paged_prefill_attention", &tokenmill::paged_prefill_attention,
        "prompt-chunk attention over a paged KV cache, causal to each sequence's positions");
  m.def("prefill_dtypes", &tokenmill::prefill_dtypes, "the dtypes paged_prefill_attention was built for");
  m.def("screened_argmax", &tokenmill::screened_argmax,
        "greedy tokens of fp32 x W^T from int8 screening logits; returns (tokens, candidates per row)");
  m.def("screened_argmax_available", &tokenmill::screened_argmax_available,
        "whether screened_argmax was built (it needs AVX512-VNNI or AVX2)");
  m.def("parallel_threads", &tokenmill::parallel_threads,
        "the threads at::parallel_for runs the kernels on (1 where the build has no OpenMP)");
  pybind11::class_<tokenmill::DecodeStack>(
      m, "DecodeStack", "a Llama-style decoder stack for 1-2 decode rows, or a verify step's up to 8, in one call",
      pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t>(), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"),
           pybind11::arg("head_dim"))
      .def("add_layer", &tokenmill::DecodeStack::add_layer)
      .def("forward", &tokenmill::DecodeStack::forward, pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("slots"), pybind11::arg("block_table"), pybind11::arg("seq_lens"),
           pybind11::arg("query_start") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
}
