// The part of ATen the kernel files use: at::Tensor with its methods, at::parallel_for, and
// the few at:: functions they call, each from its own operator header. <ATen/ATen.h> declares
// all of ATen's operators and takes about 14 s to parse, torch/library.h and pybind11 another
// 10 s; every .cpp file of both libraries paid that before the kernels' own code. The two
// bindings files (kernels_bindings.cpp, quant_bindings.cpp) alone include those now.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>
