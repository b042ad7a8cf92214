"""Linear layers with a faster CPU inference path.

On CPU, torch's fp32 GEMM goes to MKL, whose small-M kernels (decode: M = batch size) run
2-3x slower on AMD CPUs than OpenBLAS, which numpy ships. Measured on a 2-core EPYC for a
[M, 576] x [576, 3072] product over 60 weights: M=1 65 ms (MKL) vs 22 ms (OpenBLAS), M=8
149 vs 47, M=64 304 vs 141. So inference on CPU in fp32 (`cpu_blas` on) routes through
numpy's matmul, small row counts as one GEMV per row (see gemv_rows); training and every
other device/dtype use F.linear. Weights keep their
logical [out, in] shape (state dicts unchanged) but are stored column-major, so W.t() is a
C-contiguous [in, out] array that OpenBLAS streams without a copy.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def use_numpy_blas(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Inside a compiled step (model/compiled.py) inductor's own GEMM replaces the bridge.
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_grad_enabled() and x.dim() == 2 and not torch.compiler.is_compiling())


# Rows that run as one OpenBLAS GEMV each (scripts/bench_gemm.py, 2-core EPYC, 2 threads, a
# whole SmolLM2 step's products: M=1 35 ms as a GEMV vs 56 ms as a [1, in] GEMM; M=5 83 ms
# as GEMVs vs 120 as OpenBLAS's GEMM, 103 as oneDNN's on a pre-packed weight, 268 as MKL's).
# A weight that stays in the last-level cache (32 MB here) is streamed from DRAM once and
# re-read from cache by the later rows, so GEMVs win up to 8 rows; the 113 MB tied lm_head
# is re-streamed per row, so from 4 rows on OpenBLAS's GEMM (one pass) wins there.
GEMV_ROWS_CACHED, GEMV_ROWS_STREAMED = 8, 3
CACHED_WEIGHT_BYTES = 16 << 20


def gemv_rows(weight: torch.Tensor) -> int:
    """Up to how many rows a product with this weight runs as one GEMV per row."""
    small = weight.numel() * weight.element_size() <= CACHED_WEIGHT_BYTES
    return GEMV_ROWS_CACHED if small else GEMV_ROWS_STREAMED


def matmul_wt(x: torch.Tensor, weight: torch.Tensor, fast: bool) -> torch.Tensor:
    """x [M, in] @ weight[out, in].T -> [M, out], through OpenBLAS when `fast` applies
    (CPU fp32 inference): one GEMV per row up to gemv_rows(weight) rows, else one GEMM."""
    if fast and use_numpy_blas(x, weight):
        xs, wt = x.numpy(), weight.t().numpy()
        if xs.shape[0] <= gemv_rows(weight):
            out = np.empty((xs.shape[0], wt.shape[1]), dtype=xs.dtype)
            for i in range(xs.shape[0]):
                np.matmul(xs[i], wt, out=out[i])
            return torch.from_numpy(out)
        return torch.from_numpy(np.matmul(xs, wt))
    return F.linear(x, weight)


class Linear(nn.Linear):
    """nn.Linear plus the optional CPU fast path (`cpu_blas`, off until an engine enables it)."""

    cpu_blas: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cpu_blas:
            return F.linear(x, self.weight, self.bias)
        y = matmul_wt(x, self.weight, True)
        return y if self.bias is None else y + self.bias


def set_cpu_blas(model: nn.Module, enabled: bool) -> None:
    """Turn the OpenBLAS path on/off for every module of `model` that has one (Linear layers,
    the model's lm_head product), re-laying out Linear and Embedding weights column-major
    when on (same values, same logical shape)."""
    for m in model.modules():
        if hasattr(m, "cpu_blas"):
            m.cpu_blas = enabled
        weight = m.weight if isinstance(m, (Linear, nn.Embedding)) else None
        # The (tied) embedding too: lm_head streams it as [H, V]; row lookups barely notice.
        if enabled and weight is not None and weight.device.type == "cpu" and weight.is_contiguous():
            weight.data = weight.data.t().contiguous().t()
