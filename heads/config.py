"""`HeadConfig`: which draft head, how deep its rollout, and how its loss is weighted; and
`HeadConfig.from_dict`, which reads the head config stored in checkpoints (older key names
included)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HEAD_TYPES = ("mtp", "eagle1", "eagle3", "medusa", "dflash")
POSITION_WEIGHTS = ("decay", "dpace")
HIDDEN_INPUTS = ("pre_norm", "post_norm")
# Keys stored under an older name in head checkpoints and export stamps: old -> new.
RENAMED_KEYS = {"temperature": "distill_temperature"}


def eagle3_aux_layers(num_layers: int) -> list[int]:
    """The auxiliary target layers EAGLE-3 fuses by default (low, middle, high: 1, L/2-1, L-4,
    the choice of the EAGLE-3 reference and the engines that serve it). Clamped into range so
    tiny test models (L < 8) still get valid, distinct ids."""
    return sorted({min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)})


def mask_token(cfg: "HeadConfig", vocab_size: int) -> int:
    """The mask token of a block drafter: head.mask_token_id, or the target's last vocabulary
    id (a reserved or rare token in the vocabularies we serve; the frozen embedding gives it
    a fixed row either way)."""
    mask = vocab_size - 1 if cfg.mask_token_id is None else cfg.mask_token_id
    if not 0 <= mask < vocab_size:
        raise ValueError(f"head.mask_token_id={mask} is outside the target vocabulary "
                         f"(0..{vocab_size - 1})")
    return mask


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
    Block drafters (docs/block_drafters.md):
    num_layers: the decoder layers of a dflash or eagle3 head (P-EAGLE's too; the other
      heads have one). An eagle3 head's first layer reads [embedding ; hidden], the others
      are plain decoder layers on its output (speculators' multi-layer EAGLE-3 and P-EAGLE).
    mask_token_id: the token filling a block's draft positions (dflash, and eagle3 with
      parallel_drafting); None = the target's last vocabulary id.
    parallel_drafting: eagle3 only (P-EAGLE): steps 2..K read the mask token and a learned
      mask hidden state instead of the previous draft, so one pass drafts all K.
    position_weights: dflash's per-position loss weights, "decay" (exp(-(k-1)/decay_gamma))
      or "dpace" (D-PACE confidence weights, smoothed by dpace_alpha).
    anchors_per_seq: dflash blocks trained per sequence (random anchors, at most this many).
    markov_rank: a block drafter's in-block transition bias (DSpark's Markov head, rank r;
      0 = off): d_k's logits gain a low-rank term read from d_{k-1} (heads/transition.py).
    markov_first: dflash with markov_rank: d_1's logits get the bias too, read from the
      block's anchor (the last verified token), as DSpark's Markov head does; what
      speculators' "dspark" format holds (train.export).
    confidence_head: dflash: a linear head on [features_k ; U[d_{k-1}]] (the bias's row when
      markov_rank > 0) predicting each draft's acceptance (DSpark's confidence head), fitted
      by BCE to the draft's acceptance rate Σ min(p, q) (DSpark's target), on detached inputs
      (the drafts stay the same); the engine's draft.min_confidence cut then reads it.
    confidence_weight: the weight of that BCE in the loss.
    cod_ratio, cod_ratio_min: P-EAGLE training (parallel_drafting): step k >= 2 runs at a
      random share max(cod_ratio^(k-1), cod_ratio_min) of the positions, each a subset of the
      step before's (COD sampling, heads/cod.py); 1.0 (default): every step at every position.
      speculators' P-EAGLE trains with 0.7 and 0.2.
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
    num_layers: int = 1
    mask_token_id: int | None = None
    parallel_drafting: bool = False
    position_weights: str = "decay"
    decay_gamma: float = 4.0
    dpace_alpha: float = 0.5
    anchors_per_seq: int = 64
    markov_rank: int = 0
    markov_first: bool = False
    confidence_head: bool = False
    confidence_weight: float = 1.0
    cod_ratio: float = 1.0
    cod_ratio_min: float = 0.0

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
        self._check_block_keys()

    def _check_block_keys(self) -> None:
        if self.num_layers < 1 or (self.num_layers != 1 and self.type not in ("dflash", "eagle3")):
            raise ValueError(f"head.num_layers={self.num_layers}: must be >= 1, and only "
                             f"head.type=dflash and eagle3 (P-EAGLE too) have more than one "
                             f"layer (head.type={self.type!r})")
        if self.parallel_drafting and self.type != "eagle3":
            raise ValueError(f"head.parallel_drafting=true is P-EAGLE, an eagle3 head; "
                             f"head.type={self.type!r}")
        if self.position_weights not in POSITION_WEIGHTS:
            raise ValueError(f"head.position_weights={self.position_weights!r}: use one of "
                             f"{POSITION_WEIGHTS}")
        if self.decay_gamma <= 0 or not 0 <= self.dpace_alpha <= 1:
            raise ValueError(f"head.decay_gamma must be > 0 and head.dpace_alpha in [0, 1], got "
                             f"{self.decay_gamma}, {self.dpace_alpha}")
        if self.anchors_per_seq < 1:
            raise ValueError(f"head.anchors_per_seq must be >= 1, got {self.anchors_per_seq}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"head.mask_token_id must be >= 0 or null, got {self.mask_token_id}")
        block = self.type == "dflash" or self.parallel_drafting
        if self.markov_rank < 0 or (self.markov_rank and not block):
            raise ValueError(f"head.markov_rank={self.markov_rank}: must be >= 0, and only a block "
                             "drafter (head.type=dflash, or eagle3 with parallel_drafting) has "
                             "the transition bias; a chain step reads the draft before it already")
        if self.markov_rank and self.num_steps < 2 and not self.markov_first:
            raise ValueError(f"head.markov_rank={self.markov_rank} biases drafts 2..K, but "
                             f"head.num_steps={self.num_steps} has no second draft; use "
                             "head.num_steps >= 2 or head.markov_rank=0")
        if self.markov_first and (self.type != "dflash" or not self.markov_rank):
            raise ValueError("head.markov_first=true biases d_1 from a DFlash block's anchor: it "
                             f"needs head.type=dflash and head.markov_rank > 0 (got "
                             f"{self.type!r}, rank {self.markov_rank})")
        if self.confidence_head and self.type != "dflash":
            raise ValueError("head.confidence_head=true is DSpark's, on a DFlash block: it needs "
                             f"head.type=dflash (got {self.type!r})")
        if self.confidence_weight < 0:
            raise ValueError(f"head.confidence_weight must be >= 0, got {self.confidence_weight}")
        if not (0 < self.cod_ratio <= 1 and 0 <= self.cod_ratio_min <= 1):
            raise ValueError(f"head.cod_ratio must be in (0, 1] and head.cod_ratio_min in [0, 1], "
                             f"got {self.cod_ratio}, {self.cod_ratio_min}")
        if self.cod_ratio < 1 and not self.parallel_drafting:
            raise ValueError(f"head.cod_ratio={self.cod_ratio} samples the depths of a P-EAGLE "
                             "rollout (head=peagle); a chain step k reads step k-1's output at "
                             "its position, and a DFlash head samples anchors "
                             "(head.anchors_per_seq)")
        if self.type == "dflash" and self.feature_loss_weight > 0:
            raise ValueError("head.feature_loss_weight must be 0 for head.type=dflash (its "
                             "block rows feed no next step)")

    @property
    def reads_aux(self) -> bool:
        """Whether the head reads the target's auxiliary layers (EAGLE-3, DFlash)."""
        return self.type in ("eagle3", "dflash")

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
