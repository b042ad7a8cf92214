"""Validation with the real inference implementation, on held-out conversations.

No precomputed states: the engine's target model recomputes the hidden states, the head's
rollout runs on them (all K steps), and step 1 additionally runs through the engine's paged
KV-cache attention, the path serving uses. Reported beside the training-side numbers, so
differences between training and serving numerics show up.
"""
from __future__ import annotations

import torch

from heads.base import DraftHead
from heads.objective import summarize
from heads.rollout import PackedBatch
from inference_eval.attention import BatchLayout
from inference_eval.attention.torch_backend import TorchAttentionBackend
from inference_eval.kv_cache import KVCache
from inference_eval.model.transformer import StepContext
from inference_eval.target import load_target
from precompute.data import DataConfig, load_conversations, tokenize_conversations
from train.config import TrainConfig


class Validator:
    def __init__(self, cfg: TrainConfig) -> None:
        v = cfg.validation
        self.loaded = load_target(cfg.target)
        data = DataConfig(source="sharegpt" if v.path is None or v.path.endswith(".json") else "jsonl",
                          path=v.path, skip=v.skip, limit=v.num_conversations, max_length=v.max_length)
        convs = load_conversations(data).conversations
        self.records = list(tokenize_conversations(self.loaded.tokenizer, convs, v.max_length))
        if not self.records:
            raise ValueError("validation found no held-out conversations; check validation.skip/path")
        self.backend = TorchAttentionBackend()

    @torch.no_grad()
    def __call__(self, head: DraftHead) -> dict:
        model = self.loaded.model
        was_training = head.training
        head.eval()
        total = None
        diffs = []
        engine_stats = torch.zeros(3)
        for rec in self.records:
            ids = torch.tensor(rec.input_ids, dtype=torch.long)
            n = len(ids)
            out = model(ids, self.backend.plan(BatchLayout.packed([n])), None, compute_logits=False)
            hidden = out.hidden.float()
            batch = PackedBatch(ids, hidden, torch.tensor(rec.loss_mask, dtype=torch.bool), [n])
            _, stats = head(batch)
            total = stats if total is None else total + stats
            feats = self._engine_step1(head, ids, hidden)
            ref = head.step(torch.cat([ids[1:], ids[:1] * 0]), head.first_hidden(hidden, None),
                            _rollout_ctx(head, n))[1] if head.uses_tokens else None
            if ref is not None:
                diffs.append(float((feats[:-1] - ref[:-1]).abs().max()))
                engine_stats += _step1_metrics(head, feats, hidden, batch)
        head.train(was_training)
        result = summarize(total)
        if diffs:
            rows = engine_stats[2].clamp(min=1)
            result["engine_step1_top1_acc"] = float(engine_stats[0] / rows)
            result["engine_step1_exp_accept_sampled"] = float(engine_stats[1] / rows)
            result["engine_vs_rollout_max_abs_diff"] = max(diffs)
        result["num_tokens"] = int(total[0, 3])
        return result

    def _engine_step1(self, head: DraftHead, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Step-1 features [n, H] through a paged KV cache, as the engine drafts."""
        if not head.uses_tokens:
            return head.medusa_step(1, head.first_hidden(hidden, None))
        a, n, page = head.arch, ids.numel(), 16
        pages = -(-n // page)
        cache = KVCache(1, pages, page, a.num_kv_heads, a.head_dim, dtype=hidden.dtype)
        plan = self.backend.plan(BatchLayout([n], [n], [list(range(pages))[::-1]], page))
        ctx = StepContext(head.rope_cos[plan.positions], head.rope_sin[plan.positions], plan, cache)
        tokens = torch.cat([ids[1:], ids[:1] * 0])  # x_{t+1}; the last row has no next token
        return head.step(tokens, head.first_hidden(hidden, None), ctx)[1]


def _rollout_ctx(head: DraftHead, n: int):
    from heads.rollout_attention import RolloutContext, RolloutPlan

    return RolloutContext(RolloutPlan([n]), head.rope_cos, head.rope_sin)


def _step1_metrics(head: DraftHead, feats: torch.Tensor, hidden: torch.Tensor,
                   batch: PackedBatch) -> torch.Tensor:
    """[top-1 matches, sum min(p,q), rows] for step 1 from engine-path features."""
    n = feats.shape[0]
    if n < 3:
        return torch.zeros(3)
    valid = batch.loss_mask[2:].clone()
    q = torch.softmax(head.logits(feats[:n - 2]).float(), -1)
    p = torch.softmax(head.frozen.logits(hidden[1:n - 1]).float(), -1)
    d2t = head.draft_to_target()
    if d2t is not None:
        p = p[:, d2t] / p[:, d2t].sum(-1, keepdim=True)
    match = (q.argmax(-1) == p.argmax(-1))[valid].float().sum()
    return torch.stack([match, torch.minimum(p, q).sum(-1)[valid].sum(), valid.float().sum()])


_VALIDATORS: dict[int, Validator] = {}


def validate(head: DraftHead, cfg: TrainConfig) -> dict:
    """Build the validator once per config object (target load + data), then run it."""
    key = id(cfg)
    if key not in _VALIDATORS:
        _VALIDATORS[key] = Validator(cfg)
    return _VALIDATORS[key](head)
