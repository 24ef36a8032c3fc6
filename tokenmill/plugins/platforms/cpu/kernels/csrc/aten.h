// The part of ATen the kernels use: tensors with their methods, at::parallel_for, and CPU
// allocation (at::detail::empty_cpu, as ATen's own CPU kernels allocate). Not torch/types.h,
// which declares every ATen operator, nor ATen/ops/empty.h and ATen/TensorOperators.h, which
// bring the dispatcher's factory functions and operators: each unit parses this first, and a
// first start waits for the slowest unit (this set parses in ~6 s on a 2.45 GHz Zen 3 core,
// those in 15-19 s).
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

namespace tokenmill {
// an uninitialized CPU tensor (the kernels' outputs and scratch; their inputs are CPU tensors)
inline at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::Tensor(at::detail::empty_cpu(sizes, options));
}
}  // namespace tokenmill
