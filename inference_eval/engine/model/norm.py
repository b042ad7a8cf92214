"""RMSNorm, shared by every decoder layer, attention variant and head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused kernel
        # Low precision: fp32 statistics, cast back before the weight, as HF does.
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * out.to(x.dtype)
