// The kernels as one compilation unit, beside bindings.cpp, which compiles the decode stack, the
// greedy head and the layer ops with the bindings.
//
// Each unit parses torch's headers before compiling anything (aten.h: ~6 s on a 2.45 GHz Zen 3
// core), so the kernel files as units of their own would pay that nine times. The build is two
// units of about equal time (~25-30 s each on that core), one per core of a 2-core machine: a
// first start waits for the slower one, so a kernel file moves between them to keep them level.
// Their file-local helpers (anonymous namespaces) share a unit: a name used twice fails to compile.
#include "paged_decode.cpp"
#include "gemv.cpp"
#include "onednn_gemv.cpp"
#include "paged_prefill.cpp"
#include "packed_gemm.cpp"
#include "parallel_threads.cpp"
