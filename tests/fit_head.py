"""A draft head fitted in seconds on the target's own greedy text, so tests that exercise
acceptance see drafts accepted far above chance (a random head accepts nothing)."""
from __future__ import annotations

import torch

from heads.batch import PackedBatch
from heads.config import HeadConfig
from heads.registry import build_head
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.evaluation.engines import frozen_parts_of


def fit_head_on(loaded, seqs: list[list[int]], steps: int = 40, lr: float = 3e-3,
                cfg: HeadConfig | None = None):
    """An mtp head (or `cfg`) trained `steps` full-batch AdamW steps on `seqs` (token ids,
    typically prompt + the target's greedy continuation), every position a label."""
    ids, lens = torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs]
    with torch.no_grad():
        hidden = loaded.model(ids, TorchAttentionBackend().plan(BatchLayout.packed(lens)), None,
                              compute_logits=False).hidden.float()
    torch.manual_seed(0)
    head = build_head(cfg or HeadConfig(type="mtp"), frozen_parts_of(loaded), seed=0)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    batch = PackedBatch(ids, hidden, torch.ones(len(ids), dtype=torch.bool), lens)
    for _ in range(steps):
        loss, _ = head(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return head
