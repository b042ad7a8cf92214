"""The parallel forms of DeepSeek's mixture of experts (tp.py swaps them in; shard.py says
which slice). Shapes: T tokens, H hidden, k experts per token, E routed experts.

The router is replicated and runs on every rank: each rank holds the same x (the previous
all-reduce hands every rank the same bits), so every rank routes every token the same way.

- TP-MoE: each routed expert holds Im/T of its intermediate columns (the model's own
  `Experts`, resized), the shared experts Is/T: each gives a partial [T, H].
- EP: each rank holds E/T whole experts (`LocalExperts`) and computes only the (token,
  expert) pairs routed to them; the other pairs contribute zero here and are computed on
  the rank that holds their expert. The shared experts are split as in TP-MoE (not
  replicated: replicated ones would run T times and be summed T times).

Either way `ParallelMoE` sums routed + shared partial outputs locally and completes them
with ONE all-reduce, so an MoE layer costs what a dense MLP layer does.
"""
from __future__ import annotations

import torch
from torch import nn

from inference_eval.engine.model.mlp import MLP
from inference_eval.engine.model.moe import Experts, MoE, Router, expert_sum
from inference_eval.engine.parallel import comm
from inference_eval.engine.parallel.group import TPGroup


class LocalExperts(nn.Module):
    """Routed experts [start, start + count) of E, whole: gate_up_proj [count, 2 Im, H],
    down_proj [count, H, Im]. Same arithmetic per (token, expert) as model/moe.Experts."""

    def __init__(self, count: int, start: int, inter: int, hidden: int, **kw) -> None:
        super().__init__()
        self.count, self.start, self.inter = count, start, inter
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * inter, hidden, **kw))
        self.down_proj = nn.Parameter(torch.empty(count, hidden, inter, **kw))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] (global expert ids) -> this rank's experts' share of
        Σ_k weights · expert_ids(x) [T, H] (zero rows for tokens routed elsewhere)."""
        local = ids.reshape(-1) - self.start
        here = ((local >= 0) & (local < self.count)).nonzero().flatten()  # flat (token, slot)
        return expert_sum(self, x, weights, here, local[here])


class ParallelMoE(MoE):
    """The model's MoE over split experts: its forward (router, routed experts, + shared
    experts) gives this rank's partial [T, H]; one all-reduce completes it. Keeps MoE's
    parameter names (gate, experts, shared_experts), so specs, loading and fingerprints
    address it as the single-device model."""

    def __init__(self, gate: Router, experts: Experts | LocalExperts, shared: MLP | None,
                 tp: TPGroup) -> None:
        nn.Module.__init__(self)
        self.gate, self.experts, self.shared_experts, self.tp = gate, experts, shared, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], the same on every rank."""
        return comm.all_reduce(super().forward(x), self.tp)
