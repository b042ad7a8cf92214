"""Typed configs of `python -m train` (conf/train.yaml)."""
from __future__ import annotations

from dataclasses import dataclass, field

from heads.config import HeadConfig
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.target import TargetConfig
from precompute.data.config import HELDOUT_SKIP, DataConfig

STRATEGIES = ("auto", "none", "ddp", "fsdp", "deepspeed")
PRECISIONS = ("auto", "no", "bf16", "fp16")
WANDB_MODES = ("offline", "online", "disabled")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainDataConfig:
    """shards: precompute output_dir(s). online: no shards; the target runs in this job on
    the records of the `source` group (train/online.py, docs/online.md), with precompute's
    settings for the same bits: hidden_dtype, aux ("auto": eagle3's layers for the heads
    that read auxiliary layers), shard_tokens and forward_tokens (precompute's batch_tokens).
    cache_tokens: states of records computed ahead of their micro-batch kept in memory
    (older ones are recomputed)."""

    shards: str = "runs/shards"
    batch_tokens: int = 8192  # packed tokens per micro-batch (per rank)
    verify_checksums: bool = True
    online: bool = False
    hidden_dtype: str = "bfloat16"
    aux: str = "auto"
    shard_tokens: int = 262144
    forward_tokens: int = 4096
    cache_tokens: int = 1 << 21

    def __post_init__(self) -> None:
        from precompute.config import HIDDEN_DTYPES, aux_layer_ids

        if self.batch_tokens < 1:
            raise ValueError(f"data.batch_tokens must be >= 1, got {self.batch_tokens}")
        if not isinstance(self.online, bool):
            raise TypeError(f"data.online must be true or false, got {self.online!r}")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"data.hidden_dtype={self.hidden_dtype!r}: use one of "
                             f"{HIDDEN_DTYPES}")
        if self.aux != "auto":
            aux_layer_ids(self.aux, 1 << 20, "data.aux")
        for key in ("shard_tokens", "forward_tokens", "cache_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key} must be >= 1, got {getattr(self, key)}")


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0
    grad_accum: int = 1

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.grad_accum < 1:
            raise ValueError(f"optim.grad_accum must be >= 1, got {self.grad_accum}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass
class StageConfig:
    """One stage of a staged rollout schedule: train with K = num_steps draft steps for this
    fraction of the optimizer steps (stages run in order; fractions sum to 1)."""

    num_steps: int = 1
    fraction: float = 1.0


@dataclass
class TrainerConfig:
    """max_steps: optimizer steps, unless epochs is set: then steps = epochs x shard tokens /
    (batch_tokens x world x grad_accum). stages: a staged K schedule (e.g. K=1 then K=4 from
    that warm start); empty = head.num_steps throughout. init_from: a head checkpoint (ours or
    any format heads.formats reads) whose weights start this run (weights only: optimizer,
    schedule and data start fresh). init_from_target: start the head's decoder layer and final
    norm from the target's last layer (mtp, eagle1). early_stop_patience: stop after this many
    validations in a row without a better real τ (0 = never); the best head by real τ is kept
    in output_dir/checkpoints/best either way."""

    strategy: str = "auto"  # auto: ddp under torchrun, none otherwise
    mixed_precision: str = "auto"  # auto: bf16 on CUDA with bf16 support, else no
    max_steps: int = 200  # optimizer steps
    epochs: float | None = None
    stages: list[StageConfig] = field(default_factory=list)
    init_from: str | None = None
    init_from_target: bool = False
    early_stop_patience: int = 0
    seed: int = 0
    log_every: int = 10
    save_every: int = 100
    eval_every: int = 100
    loss_chunk: int = 1024
    wandb: str = "offline"
    wandb_project: str = "specheads"
    tensorboard: bool = False
    progress: bool = True
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"trainer.strategy={self.strategy!r}: use one of {STRATEGIES}")
        if self.mixed_precision not in PRECISIONS:
            raise ValueError(f"trainer.mixed_precision={self.mixed_precision!r}: use one of {PRECISIONS}")
        if self.wandb not in WANDB_MODES:
            raise ValueError(f"trainer.wandb={self.wandb!r}: use one of {WANDB_MODES}")
        if self.max_steps < 1:
            raise ValueError(f"trainer.max_steps must be >= 1, got {self.max_steps}")
        for key in ("log_every", "save_every", "eval_every", "loss_chunk"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key} must be >= 1, got {getattr(self, key)}")
        if self.device not in DEVICES:
            raise ValueError(f"trainer.device={self.device!r}: use one of {DEVICES}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"trainer.epochs must be > 0 (or null to use max_steps), got {self.epochs}")
        if self.early_stop_patience < 0:
            raise ValueError(f"trainer.early_stop_patience must be >= 0, got {self.early_stop_patience}")
        if self.init_from is not None and self.init_from_target:
            raise ValueError("trainer.init_from and trainer.init_from_target both set: start from "
                             "a head checkpoint or from the target's layer, not both")
        if self.stages:
            self.stages = [s if isinstance(s, StageConfig) else StageConfig(**s) for s in self.stages]
            if any(s.num_steps < 1 or s.fraction <= 0 for s in self.stages):
                raise ValueError("trainer.stages: every stage needs num_steps >= 1 and fraction > 0")
            total = sum(s.fraction for s in self.stages)
            if abs(total - 1.0) > 1e-6:
                raise ValueError(f"trainer.stages: fractions sum to {total:g}, they must sum to 1")


@dataclass
class ValidationConfig:
    """Engine-side validation on held-out ShareGPT conversations (records >= HELDOUT_SKIP).

    tau_prompts: the first user turns of this many of those conversations (at most
    num_conversations) are decoded with real speculative decoding (greedy, a chain of
    tau_num_draft drafts, default head.num_steps) for the measured τ; 0 disables it. With
    tau_prompts_path, the first tau_prompts prompts of that prompt set (heldout_mix: many
    categories) or file (any format `python -m inference_eval prompts=jsonl` reads) instead.
    tau_max_new_tokens: tokens generated per prompt."""

    enabled: bool = True
    num_conversations: int = 8
    max_length: int = 512
    skip: int = HELDOUT_SKIP
    path: str | None = None  # another ShareGPT/JSONL file instead of the embedded one
    tau_prompts: int = 4
    tau_max_new_tokens: int = 32
    tau_num_draft: int | None = None  # chain K of the real-τ run; None = head.num_steps
    tau_prompts_path: str | None = None  # a prompt set name (heldout_mix) or a prompt JSONL

    def __post_init__(self) -> None:
        for key in ("num_conversations", "max_length", "tau_max_new_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"validation.{key} must be >= 1, got {getattr(self, key)}")
        if self.tau_prompts < 0:
            raise ValueError(f"validation.tau_prompts must be >= 0 (0 = off), got {self.tau_prompts}")
        if self.tau_num_draft is not None and self.tau_num_draft < 1:
            raise ValueError(f"validation.tau_num_draft must be >= 1, got {self.tau_num_draft}")


@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    data: TrainDataConfig = field(default_factory=TrainDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    output_dir: str = "runs/head"
    # data.online=true: the records to train on, the `source` group (conf/source/, the same
    # presets as precompute's `data` group: sharegpt, jsonl, hf, mix; source.regenerate).
    source: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        if self.source.source == "mix" and not self.source.regenerate and self.data.online:
            raise ValueError("source=mix holds prompts only: set source.regenerate=true so the "
                             "target answers them")
        stages = self.trainer.stages
        if stages and self.head.type == "medusa":
            raise ValueError("trainer.stages: a medusa head's K is its number of heads and cannot "
                             "change during training; set head.num_steps instead")
        if stages and self.head.type == "dflash":
            raise ValueError("trainer.stages: a dflash head's block (head.num_steps + 1 rows) is "
                             "fixed when it is built; set head.num_steps instead")
        if stages and stages[-1].num_steps != max(s.num_steps for s in stages):
            raise ValueError("trainer.stages: the last stage must have the largest num_steps (the "
                             "head is saved with it)")
