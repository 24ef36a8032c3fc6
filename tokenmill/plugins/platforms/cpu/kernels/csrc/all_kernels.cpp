// The kernels as one compilation unit, beside bindings.cpp.
//
// Each unit parses torch's headers before compiling anything (aten.h: ~10 s on a 2.45 GHz Zen 3
// core), so the kernel files as units of their own would pay that nine times. With bindings.cpp
// (pybind11) the build is two units of about equal time (~31 and ~40 s on that core), one per
// core of a 2-core machine: a first start waits for the slower one.
// Their file-local helpers (anonymous namespaces) share this unit: a name used twice fails to compile.
#include "paged_decode.cpp"
#include "layer_ops.cpp"
#include "gemv.cpp"
#include "onednn_gemv.cpp"
#include "decode_stack.cpp"
#include "paged_prefill.cpp"
#include "screened_argmax.cpp"
#include "packed_gemm.cpp"
#include "parallel_threads.cpp"
