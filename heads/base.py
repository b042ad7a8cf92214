"""What every draft head shares: frozen target parts, rotary tables, the step interface.

A head step maps (token ids [T], hidden input [T, H_in]) to (next hidden [T, H], features
[T, H]); features go through the lm_head to logits, the next hidden feeds step k+1. The same
`step` runs in training (RolloutContext) and in the engine (paged StepContext).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from heads.config import HeadConfig
from heads.frozen import FrozenHead, FrozenParts
from inference_eval.engine.model.linear import matmul_wt
from inference_eval.engine.model.rope import rope_inv_freq, rope_tables


class DraftHead(nn.Module):
    uses_tokens = True  # Medusa does not

    def __init__(self, cfg: HeadConfig, parts: FrozenParts) -> None:
        super().__init__()
        self.cfg = cfg
        self.arch = replace(parts.arch, num_layers=1)
        self.target_identity = parts.identity
        self.register_buffer("embed", parts.embed.detach(), persistent=False)
        self.frozen = FrozenHead(parts)
        a = self.arch
        cos, sin = rope_tables(rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling),
                               a.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # ---- the interface -------------------------------------------------------------------
    def first_hidden(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """Step-1 hidden input from the target: hidden [T, H] pre-norm, aux [T, A, H]."""
        return hidden

    def feature_target(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head's next hidden should match at a position (feature loss)."""
        return hidden

    def step(self, tokens: torch.Tensor, hidden_in: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V_draft, H]: the frozen target lm_head unless a head has its own."""
        return self.frozen.weight

    def draft_to_target(self) -> torch.Tensor | None:
        """d2t as absolute ids [V_draft] for reduced vocabularies; None = identity."""
        return None

    def logits(self, features: torch.Tensor, cpu_blas: bool = False) -> torch.Tensor:
        """features [T, H] -> logits [T, V_draft] (target vocabulary unless reduced).
        cpu_blas: the engine's OpenBLAS path for inference on CPU (inference_eval.engine.model.linear)."""
        return matmul_wt(features, self.lm_head_weight.to(features.dtype), cpu_blas)

    def forward(self, batch, chunk: int = 1024, naive: bool = False):
        """Training objective over a packed batch -> (loss, stats [K, 4]); see heads/objective.
        Routed through forward so DDP/FSDP/DeepSpeed wrappers see the call."""
        from heads.objective import head_objective

        return head_objective(self, batch, chunk=chunk, naive=naive)

    # ---- checkpoint helpers --------------------------------------------------------------
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Only the weights training changes: what a head checkpoint stores."""
        return {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}

    def config_dict(self) -> dict:
        return {}

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> E[tokens] [T, H] in the dtype of the head's own weights: in training
        the frozen table stays in the target's dtype (bf16) beside fp32 master weights
        (train/precision.py), and casting the gathered rows costs T x H, the table V x H."""
        return self.embed[tokens].to(self.frozen.norm.weight.dtype)
