"""`PackedBatch`: the batch contract between train/ and heads/.

Training data (train/data.py) and validation (train/validate.py) build it; the rollout and the
objective (heads/rollout.py, heads/objective.py) read it. S conversations are packed end to
end into one token axis of N rows; `seq_lens` says where each one ends, and no head step may
read across that boundary (the alignment table in heads/rollout.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """input_ids [N] int64, hidden [N, H] (target, pre-norm), aux [N, A, H] or None,
    loss_mask [N] bool, seq_lens: lengths of the S packed sequences (sum N). draw_seed: the
    seed of the objective's random draws for this batch (a block drafter's anchors); training
    derives it from the run's seed and the micro-batch's global index (train/data.py), so
    ranks, gradient accumulation and resumed runs draw alike; None: the global generator."""

    input_ids: torch.Tensor
    hidden: torch.Tensor
    loss_mask: torch.Tensor
    seq_lens: list[int]
    aux: torch.Tensor | None = None
    draw_seed: int | None = None

    def to(self, device, dtype=None) -> "PackedBatch":
        f = (lambda t: None if t is None else t.to(device, dtype))
        return PackedBatch(self.input_ids.to(device), f(self.hidden), self.loss_mask.to(device),
                           self.seq_lens, f(self.aux), self.draw_seed)
