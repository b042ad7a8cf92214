"""DeepSeek mixture of experts: a router, routed SwiGLU experts, always-on shared experts.

    y = shared_experts(x) + Σ_{e in topk(x)} w_e(x) · expert_e(x)

Routing (scores s [T, E] fp32 from the gate's logits; `ModelArch.scoring_func/topk_method`):

    softmax + greedy                s = softmax(logits); top-k of s
    softmax + group_limited_greedy  groups ranked by their best s; experts outside the
                                    topk_group best groups set to 0; top-k of s (V2)
    sigmoid + noaux_tc              s = sigmoid(logits); choice c = s + e_score_correction_bias;
                                    groups ranked by the sum of their two best c; top-k of c
                                    in the topk_group best groups; weights from s, not c (V3)

then w = w / Σw when norm_topk_prob, and w *= routed_scaling_factor. transformers' V2 router
ignores norm_topk_prob (every released V2 config has it false); we apply it as DeepSeek's
own code does.

The experts run as a plain loop over the experts that received tokens: correct on CPU and
cheap at the batch sizes a CPU engine sees; a grouped GEMM is the GPU path's job.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.mlp import MLP


class Router(nn.Module):
    """weight [E, H] and (sigmoid routing) e_score_correction_bias [E]; both run in fp32."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.weight = nn.Parameter(torch.empty(arch.n_routed_experts, arch.hidden_size))
        # A parameter, not a buffer, so the loader's coverage check demands it.
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(arch.n_routed_experts))
                                        if arch.scoring_func == "sigmoid" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
        a = self.arch
        logits = F.linear(x.float(), self.weight.float())
        if a.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
            choice = scores
            if a.topk_method == "group_limited_greedy":
                group_best = scores.view(len(x), a.n_group, -1).amax(dim=-1)
                choice = self._mask_groups(scores, group_best, 0.0)
        else:  # sigmoid + noaux_tc
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            if a.n_group and a.n_group > 1:
                group_best = choice.view(len(x), a.n_group, -1).topk(2, dim=-1).values.sum(-1)
                choice = self._mask_groups(choice, group_best, float("-inf"))
        ids = choice.topk(a.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if a.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * a.routed_scaling_factor, ids

    def _mask_groups(self, choice: torch.Tensor, group_score: torch.Tensor,
                     fill: float) -> torch.Tensor:
        """Keep the experts of each token's topk_group best groups; the rest get `fill`."""
        a = self.arch
        best = group_score.topk(a.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.repeat_interleave(a.n_routed_experts // a.n_group, dim=1)
        return choice.masked_fill(~keep, fill)


class Experts(nn.Module):
    """gate_up_proj [E, 2 I, H] ([gate; up] rows per expert), down_proj [E, H, I]."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        e, h, i = arch.n_routed_experts, arch.hidden_size, arch.moe_intermediate_size
        self.inter = i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> Σ_k weights · expert_ids(x) [T, H] (x's dtype)."""
        flat = ids.reshape(-1)
        return expert_sum(self, x, weights, torch.arange(flat.numel(), device=flat.device), flat)


def expert_sum(experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
               local: torch.Tensor) -> torch.Tensor:
    """Σ over the given (token, slot) pairs of weight · expert(x) -> [T, H] (x's dtype).

    experts: gate_up_proj [n, 2 I, H], down_proj [n, H, I], inter = I; weights [T, k];
    slots [N] flat token * k + slot indices to compute, local [N] their expert in 0..n-1.
    One grouped product per expert (its tokens gathered), in expert order."""
    out = torch.zeros_like(x)
    k = weights.shape[1]
    order = slots[local.argsort(stable=True)]
    counts = torch.bincount(local, minlength=experts.gate_up_proj.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start:start + n]
        start += n
        tok = sel // k
        gate, up = F.linear(x[tok], experts.gate_up_proj[e]).split([experts.inter] * 2, -1)
        y = F.linear(F.silu(gate) * up, experts.down_proj[e])
        out.index_add_(0, tok, (y * weights.reshape(-1)[sel, None]).to(x.dtype))
    return out


class MoE(nn.Module):
    """Router + routed experts + shared experts (a SwiGLU MLP of n_shared_experts x
    moe_intermediate_size). Named like transformers' module: gate, experts, shared_experts."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate = Router(arch)
        self.experts = Experts(arch)
        shared = arch.n_shared_experts * arch.moe_intermediate_size
        self.shared_experts = MLP(arch, intermediate_size=shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)
