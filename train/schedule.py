"""Linear warmup then cosine decay to lr * min_lr_ratio, as a LambdaLR factor."""
from __future__ import annotations

import math

import torch

from train.config import OptimConfig


def make_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             weight_decay=cfg.weight_decay)


def make_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
