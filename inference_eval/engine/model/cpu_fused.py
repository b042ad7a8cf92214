"""The decoder layer's elementwise steps as one pass each on CPU fp32 inference.

Eagerly, a layer's small ops are ~25 aten calls, each a full pass over [T, H] or [T, 2I]
activations: F.rms_norm is pow, mean, add, rsqrt and two muls on CPU; rotate-half rope is
slices, neg, cat and four muls for q and k; SwiGLU is silu then mul. In precompute's
4096-row batches they took 4.4 s of a 21 s dump of 12 ShareGPT chats (torch profiler, the
2-core Xeon: mul 2.0 s over 1350 calls, silu 0.7, add 0.7, cat 0.3, pow 0.3), at one
thread where OpenBLAS runs the products (linear.openblas_threads). cpu_fused.cpp does each
in one pass on the engine's own thread count: RMSNorm (with the residual add before the
post-attention norm), silu(gate) * up, and q / k rotated and v split out of the fused qkv
rows, contiguous, so attention's kernels copy nothing.

Used where the CPU fast path is on (linear.set_cpu_blas, the same switch as the product
kernel) and `applies`: built, fp32 on CPU, no autograd (heads train through the same layer
code with torch's ops), not inside a compiled step (inductor fuses those ops itself there).
Built once per machine (engine/native.py); where it cannot be built, torch's ops serve.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from inference_eval.engine import native

_state = {"threads": 1}


@functools.cache
def kernel():
    """The compiled module, or None where it cannot be built."""
    return native.build(Path(__file__).with_suffix(".cpp"),
                        "norms, rope and SwiGLU use torch's ops instead")


def enable(threads: int) -> None:
    """Build (or load) the kernel and set its thread count (the process's, as the product
    kernel's: set once by linear.set_cpu_blas, never inside a step)."""
    kernel()
    _state["threads"] = max(1, threads)


def applies(*xs: torch.Tensor) -> bool:
    return (not torch.compiler.is_compiling() and kernel() is not None
            and all(x.device.type == "cpu" and x.dtype == torch.float32 for x in xs)
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in xs)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """x [..., H] -> RMSNorm(x) * weight, same shape; with residual [..., H]: (x + residual,
    RMSNorm(x + residual) * weight)."""
    shape = x.shape
    rows = lambda t: t.reshape(-1, shape[-1])  # noqa: E731  (a view for contiguous rows)
    out = kernel().rms_norm(rows(x), weight.contiguous(), eps,
                            None if residual is None else rows(residual), _state["threads"])
    out = [o.view(shape) for o in out]
    return out[0] if residual is None else tuple(out)


def silu_mul_applies(gate_up: torch.Tensor) -> bool:
    return applies(gate_up) and (gate_up.shape[-1] // 2) % kernel().vector_width == 0


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""
    return kernel().silu_mul(gate_up, _state["threads"])


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
               kv_heads: int, head_dim: int, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, eps: float = 1e-6
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (heads + 2 kv_heads) d], cos / sin [T, d] (rotate-half layout) -> q [T, heads,
    d] and k [T, kv_heads, d] rotated, v [T, kv_heads, d]; all three contiguous. q_norm /
    k_norm [d]: a q/k-normed layer's RMSNorm weights, applied per head before the rotation."""
    return tuple(kernel().rope_split(qkv, cos.contiguous(), sin.contiguous(), heads, kv_heads,
                                     head_dim, _state["threads"], q_norm, k_norm, eps))
