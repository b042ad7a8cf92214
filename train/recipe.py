"""The training recipe around the loop: how long (epochs -> steps), which rollout depth K at
which step (staged TTT schedule), and where the weights start (random, a head checkpoint, or
the target's own last layer).

Staged schedule: `trainer.stages` lists (num_steps, fraction) pairs in order, e.g. K=1 for the
first 30% of the optimizer steps, then K=4 from that warm start for the rest. The heads' step
does not depend on K (one shared layer is unrolled K times), so changing K only changes how
far the rollout goes; Medusa's K is its number of heads and cannot change.
"""
from __future__ import annotations

import math

import torch

from heads.base import DraftHead
from heads.checkpoint import load_head
from heads.frozen import FrozenParts


def steps_from_epochs(epochs: float, batches_per_epoch: int, micro_batches_per_step: int) -> int:
    """Optimizer steps that pass `epochs` times over the shards (at least 1): an epoch is
    `batches_per_epoch` packed micro-batches (ShardStore.batches), a step consumes
    micro_batches_per_step of them (world x grad_accum)."""
    return max(1, math.ceil(epochs * batches_per_epoch / micro_batches_per_step))


def stage_bounds(stages: list, max_steps: int) -> list[tuple[int, int]]:
    """[(end_step, num_steps)] per stage: stage i runs while step < end_step (0-based steps).
    Fractions are cumulated and rounded once, so the last stage always ends at max_steps."""
    bounds, acc = [], 0.0
    for s in stages:
        acc += s.fraction
        bounds.append((max_steps if s is stages[-1] else round(acc * max_steps), s.num_steps))
    return bounds


def rollout_depth(stages: list, step: int, max_steps: int, default: int) -> int:
    """K for optimizer step `step` (0-based): the stage's num_steps, or `default` without stages."""
    for end, k in stage_bounds(stages, max_steps):
        if step < end:
            return k
    return default


def warm_start(head: DraftHead, checkpoint: str, parts: FrozenParts) -> None:
    """Weights only: copy every trainable tensor of a head checkpoint (ours or any format
    heads.formats reads) into `head`; optimizer, schedule and data position start fresh. The
    checkpoint must hold exactly the head's trainable tensors with the same shapes."""
    source = load_head(checkpoint, parts, expect_type=head.cfg.type)
    theirs, mine = source.trainable_state(), head.trainable_state()
    if set(theirs) != set(mine):
        raise ValueError(f"trainer.init_from={checkpoint}: its head has tensors "
                         f"{sorted(set(theirs) ^ set(mine))[:5]} that this head does not share; "
                         "warm-start only from a head of the same type and shape")
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name in theirs:
                if theirs[name].shape != p.shape:
                    raise ValueError(f"trainer.init_from={checkpoint}: {name} has shape "
                                     f"{tuple(theirs[name].shape)}, this head {tuple(p.shape)}")
                p.copy_(theirs[name].to(p.dtype))
        for name, b in head.named_buffers():  # e.g. a reduced vocabulary's d2t ids
            src = dict(source.named_buffers()).get(name)
            if src is not None and src.shape == b.shape and name not in ("embed", "rope_cos", "rope_sin"):
                b.copy_(src)


TARGET_INIT_HEADS = ("mtp", "eagle1")


def init_from_target_layer(head: DraftHead, layer_state: dict[str, torch.Tensor],
                           final_norm: torch.Tensor) -> list[str]:
    """Start the head's decoder layer from the target's last decoder layer (`layer_state`, our
    parameter names of one DecoderLayer) and its final norm from the target's: the head then
    begins as one more pass of a layer that already speaks the lm_head's language. Returns the
    names copied. Only heads whose layer has the target's shapes (mtp, eagle1)."""
    if head.cfg.type not in TARGET_INIT_HEADS:
        raise ValueError(f"trainer.init_from_target: a {head.cfg.type!r} head's layer does not "
                         f"have the target's shapes; use it with head={'|'.join(TARGET_INIT_HEADS)}")
    copied = []
    with torch.no_grad():
        for name, p in head.layer.named_parameters():
            if name in layer_state:
                p.copy_(layer_state[name].to(p.dtype))
                copied.append(f"layer.{name}")
        norm = getattr(head, "final_norm", None)
        if norm is not None:
            norm.weight.copy_(final_norm.to(norm.weight.dtype))
            copied.append("final_norm.weight")
    if not any(c.startswith("layer.") for c in copied):
        raise ValueError("trainer.init_from_target: no tensor of the target's last layer matched "
                         "the head's layer")
    return copied
