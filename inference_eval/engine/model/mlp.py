"""The SwiGLU MLP: dense layers, and DeepSeek's shared experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_eval.engine.model import cpu_fused
from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.linear import Linear


class MLP(nn.Module):
    """x [T, H] -> down(silu(gate(x)) * up(x)) [T, H]; gate and up fused in `gate_up_proj`.
    `intermediate_size` defaults to the arch's (DeepSeek's shared experts pass their own)."""

    cpu_blas: bool = False  # the CPU fast path (linear.set_cpu_blas): cpu_fused's SwiGLU

    def __init__(self, arch: ModelArch, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.inter = intermediate_size or arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.cpu_blas and cpu_fused.silu_mul_applies(gate_up):
            return self.down_proj(cpu_fused.silu_mul(gate_up))
        gate, up = gate_up.split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)
