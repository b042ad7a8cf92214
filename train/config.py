"""Typed configs of `python -m train` (conf/train.yaml)."""
from __future__ import annotations

from dataclasses import dataclass, field

from heads.config import HeadConfig
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.target import TargetConfig
from precompute.data.config import HELDOUT_SKIP

STRATEGIES = ("auto", "none", "ddp", "fsdp", "deepspeed")
PRECISIONS = ("auto", "no", "bf16", "fp16")
WANDB_MODES = ("offline", "online", "disabled")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainDataConfig:
    shards: str = "runs/shards"
    batch_tokens: int = 8192  # packed tokens per micro-batch (per rank)
    verify_checksums: bool = True

    def __post_init__(self) -> None:
        if self.batch_tokens < 1:
            raise ValueError(f"data.batch_tokens must be >= 1, got {self.batch_tokens}")


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
class TrainerConfig:
    strategy: str = "auto"  # auto: ddp under torchrun, none otherwise
    mixed_precision: str = "auto"  # auto: bf16 on CUDA with bf16 support, else no
    max_steps: int = 200  # optimizer steps
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


@dataclass
class ValidationConfig:
    """Engine-side validation on held-out ShareGPT conversations (records >= HELDOUT_SKIP).

    tau_prompts: the first user turns of this many of those conversations (at most
    num_conversations) are decoded with real speculative decoding (greedy, a chain of
    head.num_steps drafts) for the measured τ; 0 disables it. tau_max_new_tokens: tokens
    generated per prompt."""

    enabled: bool = True
    num_conversations: int = 8
    max_length: int = 512
    skip: int = HELDOUT_SKIP
    path: str | None = None  # another ShareGPT/JSONL file instead of the embedded one
    tau_prompts: int = 4
    tau_max_new_tokens: int = 32

    def __post_init__(self) -> None:
        for key in ("num_conversations", "max_length", "tau_max_new_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"validation.{key} must be >= 1, got {getattr(self, key)}")
        if self.tau_prompts < 0:
            raise ValueError(f"validation.tau_prompts must be >= 0 (0 = off), got {self.tau_prompts}")


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
