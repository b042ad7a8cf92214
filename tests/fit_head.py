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
    return train_steps(head, PackedBatch(ids, hidden, torch.ones(len(ids), dtype=torch.bool),
                                         lens), steps, lr)


def train_steps(head, batch: PackedBatch, steps: int, lr: float, seed: int | None = None):
    """`steps` full-batch AdamW steps of `head` on `batch` (torch seeded first when `seed`
    is given: the heads that draw anchors or rollouts draw the same ones every run)."""
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    if seed is not None:
        torch.manual_seed(seed)
    for _ in range(steps):
        loss, _ = head(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return head


def fit_on_greedy(loaded, prompts: list[list[int]], new_tokens: int = 20, **kw):
    """fit_head_on (its keywords: steps, lr, cfg) over each prompt followed by the target's
    own greedy continuation of `new_tokens` tokens: a head that drafts what the target says
    often but not always, so greedy lossless tests run both the accept and the reject path."""
    from inference_eval.engine.config import EngineConfig
    from inference_eval.engine.llm_engine import LLMEngine
    from inference_eval.engine.sampling import SamplingParams

    ar = LLMEngine(loaded.model, None, EngineConfig(attention="torch", page_size=4)).generate(
        prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), progress=False)
    return fit_head_on(loaded, [r.prompt_ids + r.token_ids for r in ar], **kw)
