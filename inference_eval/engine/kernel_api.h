// The torch headers the engine's CPU kernels need: tensors, at::empty(_like) and pybind11's
// casters for tensors, optionals and tuples. <torch/extension.h> (the whole C++ frontend)
// cost 32 s of each kernel's 33 s build on 2 cores; these parse in about half of that.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
