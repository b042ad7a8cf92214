"""The target's fingerprints (target.weights_hash / frozen_hash) from a split model: the same
strided samples of every full tensor, each taken on the rank that holds it, so the identity a
head or a report records does not depend on the tensor-parallel size."""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from inference_eval.engine.parallel import comm
from inference_eval.engine.parallel.group import TPGroup
from inference_eval.engine.parallel.shard import ShardSpec


def _sample(p: torch.Tensor, spec: ShardSpec,
            shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [S] fp32, owned [S] bool) of target._digest's samples of the full tensor."""
    numel = 1
    for s in shape:
        numel *= s
    idx = torch.arange(0, numel, max(1, numel // 4096))
    coords = []
    for s in reversed(shape):
        coords.append(idx % s)
        idx = idx // s
    coords = coords[::-1]
    if spec.dim is None:
        vals = p.detach().float().cpu()[tuple(coords)]
        return vals, torch.ones(vals.numel(), dtype=torch.bool)
    inv = torch.full((shape[spec.dim],), -1, dtype=torch.long)
    held = spec.index >= 0
    inv[spec.index[held]] = torch.arange(spec.index.numel())[held]
    local = inv[coords[spec.dim]]
    owned = local >= 0
    coords[spec.dim] = local.clamp(min=0)
    vals = p.detach().float().cpu()[tuple(coords)]
    return torch.where(owned, vals, torch.zeros_like(vals)), owned


def sharded_hashes(model: nn.Module, specs: dict[str, ShardSpec],
                   shapes: dict[str, tuple[int, ...]], tp: TPGroup) -> dict[str, str]:
    """{"weights_sha256", "frozen_sha256"} equal to target.load_target's at size 1.
    shapes: the full model's parameter shapes by name. Two all-reduces in all."""
    params = dict(model.named_parameters())
    names = sorted(shapes)
    vals, owned = zip(*(_sample(params[n], specs[n], shapes[n]) for n in names))
    sizes = [v.numel() for v in vals]
    v, o = torch.cat(vals), torch.cat(owned)
    # Replicated rows (norms, shared KV heads) are held by several ranks: the first one counts.
    owner = torch.where(o, torch.full_like(o, tp.rank, dtype=torch.long),
                        torch.full_like(o, tp.size, dtype=torch.long)).to(tp.device)
    if tp.size > 1:
        torch.distributed.all_reduce(owner, op=torch.distributed.ReduceOp.MIN, group=tp.group)
        comm.COUNTS["load_all_reduce"] += 1
    v = torch.where(owner.cpu() == tp.rank, v, torch.zeros_like(v)).to(tp.device)
    if tp.size > 1:
        torch.distributed.all_reduce(v, group=tp.group)
        comm.COUNTS["load_all_reduce"] += 1
    full = dict(zip(names, torch.split(v.cpu(), sizes)))
    head = "embed_tokens.weight" if "lm_head.weight" not in full else "lm_head.weight"
    frozen = [("embed", "embed_tokens.weight"), ("lm_head", head), ("norm", "norm.weight")]
    return {"weights_sha256": _digest([(n, shapes[n], full[n]) for n in names]),
            "frozen_sha256": _digest([(k, shapes[n], full[n]) for k, n in frozen])}


def _digest(samples: list[tuple[str, tuple[int, ...], torch.Tensor]]) -> str:
    """target._digest over already-taken samples (same byte stream)."""
    h = hashlib.sha256()
    for name, shape, vals in sorted(samples, key=lambda s: s[0]):
        h.update(name.encode())
        h.update(str(tuple(shape)).encode())
        h.update(vals.float().numpy().tobytes())
    return h.hexdigest()
