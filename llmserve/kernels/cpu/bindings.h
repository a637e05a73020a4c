// What the direct pybind11 bindings share (kernels_bindings.cpp, quant_bindings.cpp).
#pragma once

#include <torch/csrc/utils/pybind.h>  // pybind11 and its at::Tensor caster: a quarter of torch/extension.h's parse time

// Every direct binding lets go of the GIL for the kernel's run, as torch's own ops do: the
// server's event loop (another Python thread) then streams tokens while a step computes
// instead of waiting for the engine thread to come back to Python between kernels. The
// arguments are converted before and the result after, with the GIL held.
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;
