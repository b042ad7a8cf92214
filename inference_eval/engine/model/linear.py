"""Linear layers with a faster CPU inference path.

On CPU in fp32 inference (`cpu_blas` on) a product of up to cpu_linear.SMALL_ROWS rows (decode,
verification, draft steps, a prefill's last-row logits) runs in the engine's own kernel,
which reads each weight once for all rows (figures: docs/benchmarks.md); larger ones
(prefill, precompute, batched decode) too, in chunks of 128 rows, where the kernel beat
OpenBLAS in a race run once per process (cpu_linear.max_rows(): on the 2-core EPYC it wins
at every size), else numpy's matmul (OpenBLAS): torch's MKL kernels run 2-3x slower on AMD
CPUs (a [M, 576] x [576, 3072] product over 60 weights on a 2-core EPYC: M=64 304 ms MKL vs
141 OpenBLAS). Where the kernel cannot be built, small row counts
run as one OpenBLAS GEMV per row (see gemv_rows). Training and every other device/dtype use
F.linear. Weights keep torch's [out, in] row-major layout, which the kernel streams and
OpenBLAS reads transposed without a copy. A weight that is an exact GGUF block code in fp32
(the embedded target's: Q4_1 layers, a Q8_0 tied lm_head) keeps that code beside it
(`packed`, cpu_quant.py), and its small-row products read the 4-5x shorter code instead,
with the same floats as a result.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inference_eval.engine.model import cpu_fused, cpu_linear, cpu_quant


def use_numpy_blas(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Inside a compiled step (model/compiled.py) numpy cannot run: the kernel or inductor does.
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_grad_enabled() and x.dim() == 2 and not torch.compiler.is_compiling())


# Without the kernel: rows that run as one OpenBLAS GEMV each (scripts/bench_gemm.py, 2-core
# EPYC, 2 threads, a whole SmolLM2 step's products: M=1 35 ms as a GEMV vs 56 ms as a [1, in] GEMM; M=5 83 ms
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


def matmul_wt(x: torch.Tensor, weight: torch.Tensor, fast: bool,
              bias: torch.Tensor | None = None,
              packed: cpu_quant.Packed | None = None) -> torch.Tensor:
    """x [M, in] @ weight[out, in].T (+ bias [out]) -> [M, out]. With `fast` (CPU fp32
    inference): up to cpu_linear.SMALL_ROWS rows in the engine's kernel (compiled steps too),
    from `packed` (weight's exact block code, cpu_quant) where there is one: the same floats
    from a 4-5x shorter weight stream; more through OpenBLAS (one GEMV per row up to
    gemv_rows(weight) rows where the kernel is missing, else one GEMM)."""
    if fast and cpu_quant.applies(x, packed) and x.shape[0] <= cpu_linear.SMALL_ROWS:
        return cpu_quant.linear(x, packed, bias)
    if fast and cpu_linear.applies(x, weight):
        return cpu_linear.linear(x, weight, bias)
    y = _matmul_wt(x, weight, fast)
    return y if bias is None else y + bias


def _matmul_wt(x: torch.Tensor, weight: torch.Tensor, fast: bool) -> torch.Tensor:
    if fast and use_numpy_blas(x, weight):
        xs, wt = x.numpy(), weight.t().numpy()
        if xs.shape[0] <= gemv_rows(weight):
            out = np.empty((xs.shape[0], wt.shape[1]), dtype=xs.dtype)
            for i in range(xs.shape[0]):
                np.matmul(xs[i], wt, out=out[i])
            return torch.from_numpy(out)
        return torch.from_numpy(np.matmul(xs, wt))
    return F.linear(x, weight)


def openblas_threads(cpu_blas: bool) -> int | None:
    """torch's thread count inside CPU fp32 inference steps (None: leave it). Where OpenBLAS
    runs some of the products, its threads spin for a while after each call, and torch's
    OpenMP pool spinning beside them halved decode speed (measured): torch gets 1 thread.
    Where the kernel serves every row count (cpu_linear.max_rows()), there is no OpenBLAS
    to contend with, and the step's other ops take every core (a batch-64 self-distillation
    run on the 2-core EPYC: 290 -> 348 tok/s, its prefills 10.1 -> 8.5 s)."""
    return None if not cpu_blas or cpu_linear.serves_all_rows() else 1


class Linear(nn.Linear):
    """nn.Linear plus the optional CPU fast path (`cpu_blas`, off until an engine enables it)."""

    cpu_blas: bool = False
    packed: cpu_quant.Packed | None = None  # the weight's exact block code (set_cpu_blas)

    def packable_weight(self) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cpu_blas:
            return F.linear(x, self.weight, self.bias)
        return matmul_wt(x, self.weight, True, self.bias, self.packed)


def set_cpu_blas(model: nn.Module, enabled: bool, codes: bool = True) -> None:
    """Turn the CPU fast path on/off for every module of `model` that has one (Linear layers,
    the model's lm_head product; norms, attention's rope and the MLP's SwiGLU through
    cpu_fused). On, it builds both kernels once (never inside a timed step) for torch's
    current thread count, and makes Linear and Embedding (the tied
    lm_head) weights contiguous [out, in], the layout the kernel streams; with `codes`, it
    keeps each weight's exact block code beside it (cpu_quant.pack)."""
    if enabled:
        cpu_linear.enable(torch.get_num_threads())
        cpu_fused.enable(torch.get_num_threads())
    for m in model.modules():
        if hasattr(m, "cpu_blas"):
            m.cpu_blas = enabled
        weight = m.weight if isinstance(m, (Linear, nn.Embedding)) else None
        if enabled and weight is not None and weight.device.type == "cpu" and not weight.is_contiguous():
            weight.data = weight.data.contiguous()
    for m in model.modules():  # after the layouts above: a packed code belongs to its weight
        if hasattr(m, "packed"):
            _set_packed(m, enabled and codes)


def _set_packed(m: nn.Module, enabled: bool) -> None:
    """m.packed: the exact block code of m.packable_weight() (cpu_quant.pack), kept while
    the weight is unchanged (every engine over one target switches it on again), or None."""
    w = m.packable_weight() if enabled and cpu_quant.kernel() is not None else None
    # An inference tensor has no version counter (and no in-place update outside inference).
    key = None if w is None else (w.data_ptr(), -1 if w.is_inference() else w._version,
                                  tuple(w.shape), w.dtype)
    if key is None:
        m.packed = m.packed_key = None
    elif getattr(m, "packed_key", None) != key:
        m.packed, m.packed_key = cpu_quant.pack(w), key
