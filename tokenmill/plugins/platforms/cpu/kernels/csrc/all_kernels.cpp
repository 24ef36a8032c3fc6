// The kernels as one compilation unit, beside bindings.cpp.
//
// A unit's build time is mostly parsing torch's headers (~8 s for torch/types.h at -O3 on a
// 2-vCPU Zen 4), not compiling the kernels: the kernel files as units of their own cost
// ~70 s of CPU (~10 s each), included here ~28 s. With bindings.cpp (pybind11) the build is two
// units, one per core of a 2-core machine, so a first start spends ~30 s compiling, not ~60-80.
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
