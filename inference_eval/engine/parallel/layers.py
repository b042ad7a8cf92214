"""The parallel forms of the model's layers (tp.py swaps them in; shard.py says which slice).

Shapes: T tokens, H hidden, V vocabulary, Vp = ceil(V / size) rows per rank. Column-parallel
layers need no communication (each rank computes its own heads / intermediate columns); a
row-parallel layer sums its partial products with one all-reduce, so a decoder layer costs
two; the embedding one more; the lm_head one gather to the leader.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_eval.engine.model.linear import Linear
from inference_eval.engine.parallel import comm
from inference_eval.engine.parallel.group import TPGroup


class ColumnParallelLinear(Linear):
    """A Linear holding some output rows (qkv heads, gate/up columns); [T, in] -> [T, out/size]."""


class RowParallelLinear(Linear):
    """A Linear holding some input columns; [T, in/size] -> partial [T, out], summed over the
    group (one all-reduce). No bias: o_proj and down_proj have none in every family we run."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, **kw) -> None:
        super().__init__(in_features, out_features, bias=False, **kw)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(super().forward(x), self.tp)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + rows) of the embedding: ids [T] -> [T, H]. Each rank looks up the
    ids it owns, zeros elsewhere, and one all-reduce completes every row."""

    def __init__(self, rows: int, hidden: int, start: int, vocab: int, tp: TPGroup,
                 **kw) -> None:
        super().__init__(rows, hidden, **kw)
        self.start, self.vocab, self.tp = start, vocab, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return comm.all_reduce(out, self.tp)


class ParallelLMHead(Linear):
    """The lm_head's vocabulary rows (the embedding's, when tied): [N, H] -> local logits
    [N, Vp], gathered to the leader as [N, V]; the other ranks return their local [N, Vp]
    (nobody reads them: only the leader samples and verifies)."""

    def __init__(self, hidden: int, rows: int, vocab: int, tp: TPGroup, **kw) -> None:
        super().__init__(hidden, rows, bias=False, **kw)
        self.vocab, self.tp = vocab, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)
        full = comm.gather_to_leader(local, self.tp)
        return local if full is None else full[:, :self.vocab]
