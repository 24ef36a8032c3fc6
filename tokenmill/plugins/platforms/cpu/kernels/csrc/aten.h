// The part of ATen the kernels use: tensors with their methods, the four factory functions they
// call, and at::parallel_for. Not torch/types.h: that declares every ATen operator and doubles a
// unit's parse time (~19 s against ~10 on a 2.45 GHz Zen 3 core), and a first start waits for
// the slowest unit.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
