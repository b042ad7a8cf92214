// The torch headers the engine's CPU kernels need: tensors, at::empty(_like) and pybind11's
// casters for tensors, optionals and tuples. <torch/extension.h> (the whole C++ frontend)
// cost 32 s of each kernel's 33 s build on 2 cores; these parse in about half of that.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

// The product kernels' optional fp32 bias [out]: its data, or nullptr without one.
inline const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t out) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out,
              "bias [out] fp32");
  return bias->data_ptr<float>();
}
