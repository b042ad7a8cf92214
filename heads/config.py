"""`HeadConfig`: which draft head, how deep its rollout, and how its loss is weighted; and
`HeadConfig.from_dict`, which reads the head config stored in checkpoints (older key names
included)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HEAD_TYPES = ("mtp", "eagle1", "eagle3", "medusa")
HIDDEN_INPUTS = ("pre_norm", "post_norm")
# Keys stored under an older name in head checkpoints and export stamps: old -> new.
RENAMED_KEYS = {"temperature": "distill_temperature"}


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
    distill_temperature: softens both distributions in the soft cross-entropy (the
      distillation temperature; sampling temperature is the engine's sampling.temperature).
    draft_vocab_size: a reduced draft vocabulary of the most frequent training tokens (None =
        the full vocabulary); EAGLE-3 trains its own rows of it, other heads use the target's
        frozen rows (heads/vocab.py).
    hidden_input: which target state an mtp head reads, "pre_norm" (h_t, the shards'
      convention; what we train) or "post_norm" (final_norm(h_t): what vLLM and SGLang hand a
      DeepSeek-V3 MTP layer, so native MTP layers loaded from a checkpoint use it).
    hidden_noise: std of Gaussian noise added to the normed hidden input in training only
      (EAGLE's feature noise: a regularizer for heads that memorize small data; 0 = off).
    moe: the mtp head's decoder layer is a mixture-of-experts layer with the target's expert
      shapes and routing (DeepSeek-V3/R1's own MTP layer is one); needs a target with routed
      experts. False (default): a dense SwiGLU MLP of the target's intermediate_size.
    """

    type: str = "mtp"
    num_steps: int = 1
    step_weight_decay: float = 0.8
    ce_loss_weight: float = 1.0
    feature_loss_weight: float = 0.0
    distill_temperature: float = 1.0
    draft_vocab_size: int | None = None
    aux_layers: list[int] = field(default_factory=list)
    hidden_input: str = "pre_norm"
    hidden_noise: float = 0.0
    moe: bool = False

    def __post_init__(self) -> None:
        if self.type not in HEAD_TYPES:
            raise ValueError(f"head.type={self.type!r}: use one of {HEAD_TYPES}")
        if self.num_steps < 1:
            raise ValueError(f"head.num_steps must be >= 1, got {self.num_steps}")
        if not 0 < self.step_weight_decay <= 1:
            raise ValueError(f"head.step_weight_decay must be in (0, 1], got {self.step_weight_decay}")
        if self.distill_temperature <= 0:
            raise ValueError(f"head.distill_temperature must be > 0, got {self.distill_temperature}")
        if self.ce_loss_weight < 0 or self.feature_loss_weight < 0:
            raise ValueError("head.ce_loss_weight and head.feature_loss_weight must be >= 0")
        if self.ce_loss_weight == 0 and self.feature_loss_weight == 0:
            raise ValueError("head: ce_loss_weight and feature_loss_weight cannot both be 0")
        if self.type == "medusa" and self.feature_loss_weight > 0:
            # A Medusa step passes the base feature through unchanged (heads/medusa.py): no
            # draft output feeds a next step, so there is nothing for the feature loss to fit.
            raise ValueError("head.feature_loss_weight must be 0 for head.type=medusa")
        if self.hidden_input not in HIDDEN_INPUTS:
            raise ValueError(f"head.hidden_input={self.hidden_input!r}: use one of {HIDDEN_INPUTS}")
        if self.hidden_input != "pre_norm" and self.type != "mtp":
            raise ValueError(f"head.hidden_input={self.hidden_input!r} applies to mtp heads only")
        if self.moe and self.type != "mtp":
            raise ValueError(f"head.moe=true applies to mtp heads only (head.type={self.type!r}: "
                             "its export formats hold a dense Llama layer)")
        if self.hidden_noise < 0:
            raise ValueError(f"head.hidden_noise must be >= 0, got {self.hidden_noise}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"head.draft_vocab_size must be >= 1 or null, got {self.draft_vocab_size}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HeadConfig":
        """A stored head config (checkpoint config.json, export stamp) -> HeadConfig; keys
        written under an older name (RENAMED_KEYS) are read under the new one."""
        d = dict(d)
        for old, new in RENAMED_KEYS.items():
            if old in d:
                if new in d:
                    raise ValueError(f"head config has both {old!r} and its new name {new!r}")
                d[new] = d.pop(old)
        return cls(**d)
