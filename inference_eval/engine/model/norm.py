"""RMSNorm, shared by every decoder layer, attention variant and head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_eval.engine.model import cpu_fused


class RMSNorm(nn.Module):
    cpu_blas: bool = False  # the CPU fast path (linear.set_cpu_blas): cpu_fused's one pass

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_blas and cpu_fused.applies(x, self.weight):
            return cpu_fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Low precision: fp32 statistics, cast back before the weight, as HF does.
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * out.to(x.dtype)
