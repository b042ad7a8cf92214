"""`HeadConfig`: which draft head, how deep its rollout, and how its loss is weighted."""
from __future__ import annotations

from dataclasses import dataclass, field

HEAD_TYPES = ("mtp", "eagle1", "eagle3", "medusa")


def eagle3_aux_layers(num_layers: int) -> list[int]:
    """The auxiliary target layers EAGLE-3 fuses by default (low, middle, high: 1, L/2-1, L-4,
    the choice of the EAGLE-3 reference and the engines that serve it). Clamped into range so
    tiny test models (L < 8) still get valid, distinct ids."""
    return sorted({min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)})


@dataclass
class HeadConfig:
    """type: mtp (default, RMSNorm-augmented DeepSeek-V3 layout), eagle1, eagle3, medusa.
    num_steps: K draft steps trained (the rollout depth; Medusa: K heads).
    step_weight_decay: loss weight of step k is decay**(k-1).
    feature_loss_weight / ce_loss_weight: EAGLE-1 uses 1.0 smooth-L1 on features + 0.1 CE.
    temperature: softens both distributions in the soft cross-entropy.
    draft_vocab_size: EAGLE-3 reduced vocabulary (None = full vocabulary, frozen lm_head).
    """

    type: str = "mtp"
    num_steps: int = 1
    step_weight_decay: float = 0.8
    ce_loss_weight: float = 1.0
    feature_loss_weight: float = 0.0
    temperature: float = 1.0
    draft_vocab_size: int | None = None
    aux_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.type not in HEAD_TYPES:
            raise ValueError(f"head.type={self.type!r}: use one of {HEAD_TYPES}")
        if self.num_steps < 1:
            raise ValueError(f"head.num_steps must be >= 1, got {self.num_steps}")
        if not 0 < self.step_weight_decay <= 1:
            raise ValueError(f"head.step_weight_decay must be in (0, 1], got {self.step_weight_decay}")
        if self.temperature <= 0:
            raise ValueError(f"head.temperature must be > 0, got {self.temperature}")
        if self.ce_loss_weight < 0 or self.feature_loss_weight < 0:
            raise ValueError("head.ce_loss_weight and head.feature_loss_weight must be >= 0")
        if self.ce_loss_weight == 0 and self.feature_loss_weight == 0:
            raise ValueError("head: ce_loss_weight and feature_loss_weight cannot both be 0")
        if self.draft_vocab_size is not None and self.type != "eagle3":
            raise ValueError("head.draft_vocab_size is only supported by head.type=eagle3")
